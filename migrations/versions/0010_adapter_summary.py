"""Adapter versions record what the adapter changes (`summary`: modules and ranks, DoRA, embedding LoRA,
trained heads, device bytes), as validation found it at upload.

Versions uploaded before keep NULL: the API then describes them from their stored columns (rank, alpha,
target_modules), which is all such a version can hold (the formats that need a summary were refused then).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.add_column(sa.Column("summary", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("summary")
