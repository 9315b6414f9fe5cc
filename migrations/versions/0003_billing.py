"""Admin keys, prices and the cost ledger.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import Money, UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("base_model", sa.String(200), nullable=False),
        sa.Column("adapter_id", sa.String(32), sa.ForeignKey("adapters.id"), nullable=True),
        sa.Column("tier", sa.String(32), nullable=True),
        sa.Column("input_per_mtok", Money(), nullable=False),
        sa.Column("cached_input_per_mtok", Money(), nullable=False),
        sa.Column("output_per_mtok", Money(), nullable=False),
        sa.Column("effective_from", UTCDateTime(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("base_model", "adapter_id", "tier", "effective_from", name="uq_prices_scope_from"),
    )
    op.create_table(
        "ledger",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter_id", sa.String(32), nullable=True),
        sa.Column("adapter_version", sa.Integer, nullable=True),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("fallback", sa.Boolean, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("queue_ms", sa.Float, nullable=True),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("total_ms", sa.Float, nullable=False),
        sa.Column("price_id", sa.Integer, nullable=True),
        sa.Column("input_per_mtok", Money(), nullable=False),
        sa.Column("cached_input_per_mtok", Money(), nullable=False),
        sa.Column("output_per_mtok", Money(), nullable=False),
        sa.Column("cost", Money(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_ledger_tenant_created", "ledger", ["tenant_id", "created_at"])
    op.create_index("ix_ledger_created", "ledger", ["created_at"])


def downgrade() -> None:
    op.drop_table("ledger")
    op.drop_table("prices")
    op.drop_table("admin_keys")
