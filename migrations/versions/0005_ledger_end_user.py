"""The ledger records the client's end-user id (OpenAI's `user` request field).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an ALTER TABLE ADD COLUMN on both backends, no table rewrite.
    with op.batch_alter_table("ledger") as batch:
        batch.add_column(sa.Column("end_user", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger") as batch:
        batch.drop_column("end_user")
