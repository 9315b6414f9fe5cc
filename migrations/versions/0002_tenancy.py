"""Tenancy: service tiers (seeded free / standard / premium), API keys, per-tenant fallback.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

DEFAULT_TIERS = [
    # name, priority, requests/min, tokens/min, max concurrent, default timeout s, max timeout s
    ("free", 0, 60, 20_000, 4, 60.0, 120.0),
    ("standard", 1, 600, 200_000, 32, 120.0, 600.0),
    ("premium", 2, 0, 0, 128, 300.0, 1800.0),
]


def upgrade() -> None:
    tiers = op.create_table(
        "tiers",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("requests_per_min", sa.Integer, nullable=False),
        sa.Column("tokens_per_min", sa.Integer, nullable=False),
        sa.Column("max_concurrent", sa.Integer, nullable=False),
        sa.Column("default_timeout_s", sa.Float, nullable=False),
        sa.Column("max_timeout_s", sa.Float, nullable=False),
    )
    op.bulk_insert(tiers, [dict(zip(("name", "priority", "requests_per_min", "tokens_per_min", "max_concurrent",
                                     "default_timeout_s", "max_timeout_s"), row)) for row in DEFAULT_TIERS])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("fallback", sa.String(200), nullable=False, server_default="none"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("fallback")
    op.drop_table("api_keys")
    op.drop_table("tiers")
