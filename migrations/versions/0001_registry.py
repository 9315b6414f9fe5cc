"""Adapter registry: tenants, adapters, adapter_versions.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("visibility", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_adapters_tenant_id", "adapters", ["tenant_id"])
    op.create_index("uq_adapters_tenant_live_name", "adapters", ["tenant_id", "name"], unique=True,
                    postgresql_where=sa.text("deleted_at IS NULL"), sqlite_where=sa.text("deleted_at IS NULL"))
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("adapter_id", sa.String(32), sa.ForeignKey("adapters.id"), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("storage_key", sa.String(200), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Float, nullable=False),
        sa.Column("use_rslora", sa.Boolean, nullable=False),
        sa.Column("target_modules", sa.JSON, nullable=False),
        sa.Column("base_model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_version"),
    )
    op.create_index("ix_adapter_versions_adapter_id", "adapter_versions", ["adapter_id"])
    op.create_index("ix_adapter_versions_digest", "adapter_versions", ["digest"])


def downgrade() -> None:
    op.drop_table("adapter_versions")
    op.drop_index("uq_adapters_tenant_live_name", table_name="adapters")
    op.drop_table("adapters")
    op.drop_table("tenants")
