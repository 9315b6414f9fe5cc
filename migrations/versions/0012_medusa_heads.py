"""Medusa speculative-decoding heads in the registry: `medusa_heads`, one row per upload, for the base model
(adapter_version_id NULL) or for one adapter version; soft-deleted (deleted_at) or replaced (replaced_by),
at most one ready live row per (kind, target).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import UTCDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_ACTIVE_VERSION = "deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NOT NULL"
_ACTIVE_BASE = "deleted_at IS NULL AND status = 'ready' AND adapter_version_id IS NULL"


def upgrade() -> None:
    op.create_table(
        "medusa_heads",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("adapter_version_id", sa.Integer, sa.ForeignKey("adapter_versions.id"), nullable=True),
        sa.Column("base_model", sa.String(200), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("storage_key", sa.String(200), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("num_heads", sa.Integer, nullable=False),
        sa.Column("hidden_size", sa.Integer, nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("replaced_by", sa.String(32), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_medusa_heads_adapter_version_id", "medusa_heads", ["adapter_version_id"])
    op.create_index("ix_medusa_heads_digest", "medusa_heads", ["digest"])
    op.create_index("uq_medusa_heads_active_version", "medusa_heads", ["kind", "adapter_version_id"], unique=True,
                    postgresql_where=sa.text(_ACTIVE_VERSION), sqlite_where=sa.text(_ACTIVE_VERSION))
    op.create_index("uq_medusa_heads_active_base", "medusa_heads", ["kind", "base_model"], unique=True,
                    postgresql_where=sa.text(_ACTIVE_BASE), sqlite_where=sa.text(_ACTIVE_BASE))


def downgrade() -> None:
    op.drop_index("uq_medusa_heads_active_base", table_name="medusa_heads")
    op.drop_index("uq_medusa_heads_active_version", table_name="medusa_heads")
    op.drop_index("ix_medusa_heads_digest", table_name="medusa_heads")
    op.drop_index("ix_medusa_heads_adapter_version_id", table_name="medusa_heads")
    op.drop_table("medusa_heads")
