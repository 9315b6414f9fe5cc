"""Adapter hardening: the claimed base model of each version, and the blob lifecycle table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.add_column(sa.Column("claimed_base_model", sa.String(500), nullable=True))
    op.create_table(
        "adapter_blobs",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("storage_key", sa.String(200), nullable=False),
        sa.Column("pending", sa.Integer, nullable=False, server_default="0"),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("adapter_blobs")
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("claimed_base_model")
