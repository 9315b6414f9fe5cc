"""Tiers may cap the bytes of trained heads and embeddings (modules_to_save, embedding LoRA, trainable tokens)
in the adapters their tenants upload: `max_adapter_head_bytes`, 0 = only the server's limit
(LORAMUX_MAX_ADAPTER_HEAD_BYTES).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tiers") as batch:
        batch.add_column(sa.Column("max_adapter_head_bytes", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tiers") as batch:
        batch.drop_column("max_adapter_head_bytes")
