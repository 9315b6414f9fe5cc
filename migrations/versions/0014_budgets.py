"""Budgets: spend limits with reservations, tags on ledger rows, and the webhook outbox for their alerts.

- ledger.tags: a request's labels (`X-Loramux-Tags` / `metadata.tags`), NULL without any.
- budgets: a limit in USD per period for a tenant, one of its keys, an end user or a tag.
- budget_spend: each budget period's spend, kept with the ledger rows that make it.
- budget_holds: reservations of requests in flight (their worst-case cost), until their ledger rows land.
- webhooks, webhook_events: a tenant's alert endpoint and the durable outbox of events for it.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import Money, UTCDateTime

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger") as batch:
        batch.add_column(sa.Column("tags", sa.JSON(none_as_null=True), nullable=True))
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("subject", sa.String(256), nullable=False),
        sa.Column("limit_usd", Money(), nullable=False),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("hard", sa.Boolean(), nullable=False),
        sa.Column("alert_at", sa.JSON(), nullable=False),
        sa.Column("lock_version", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("tenant_id", "scope", "subject", name="uq_budgets_scope"),
    )
    op.create_index("ix_budgets_tenant_id", "budgets", ["tenant_id"])
    op.create_table(
        "budget_spend",
        sa.Column("budget_id", sa.Integer(), sa.ForeignKey("budgets.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("period_start", UTCDateTime(), primary_key=True),
        sa.Column("spent", Money(), nullable=False),
    )
    op.create_table(
        "budget_holds",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("part", sa.Integer(), primary_key=True),
        sa.Column("budget_id", sa.Integer(), sa.ForeignKey("budgets.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("period_start", UTCDateTime(), nullable=False),
        sa.Column("amount", Money(), nullable=False),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("run", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_budget_holds_budget_period", "budget_holds", ["budget_id", "period_start"])
    op.create_index("ix_budget_holds_holder", "budget_holds", ["holder"])
    op.create_table(
        "webhooks",
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("dedupe_key", sa.String(200), nullable=False, unique=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("delivered_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_webhook_events_due", "webhook_events", ["state", "next_attempt_at"])
    op.create_index("ix_webhook_events_tenant", "webhook_events", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_table("webhook_events")
    op.drop_table("webhooks")
    op.drop_table("budget_holds")
    op.drop_table("budget_spend")
    op.drop_table("budgets")
    with op.batch_alter_table("ledger") as batch:
        batch.drop_column("tags")
