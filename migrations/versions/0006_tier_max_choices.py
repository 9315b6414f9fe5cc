"""Tiers cap the choices (OpenAI's `n`) one request may ask for: free 2, standard 8, premium 16.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-15
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SEEDED = {"free": 2, "standard": 8, "premium": 16}  # other (operator-made) tiers get the column default, 8


def upgrade() -> None:
    with op.batch_alter_table("tiers") as batch:
        batch.add_column(sa.Column("max_choices", sa.Integer, nullable=False, server_default="8"))
    tiers = sa.table("tiers", sa.column("name", sa.String), sa.column("max_choices", sa.Integer))
    for name, limit in SEEDED.items():
        op.execute(tiers.update().where(tiers.c.name == name).values(max_choices=limit))


def downgrade() -> None:
    with op.batch_alter_table("tiers") as batch:
        batch.drop_column("max_choices")
