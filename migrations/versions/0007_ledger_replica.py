"""The ledger records which engine replica served each request (scale-out on Ray Serve; NULL in one process).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an ALTER TABLE ADD COLUMN on both backends, no table rewrite.
    with op.batch_alter_table("ledger") as batch:
        batch.add_column(sa.Column("replica", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger") as batch:
        batch.drop_column("replica")
