"""Adapter versions record the base model family (HF model_type) their weights were validated against.

Versions uploaded before keep NULL: which family validated them was not recorded, and guessing from the
served model at migration time could be wrong (the operator may have changed it since).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.add_column(sa.Column("base_family", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("base_family")
