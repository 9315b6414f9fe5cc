"""Console sign-out revokes the session server-side: the ids of signed-out sessions until their cookies expire.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10
"""
import sqlalchemy as sa
from alembic import op

from loramux.db.models import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_revoked_sessions",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_console_revoked_sessions_expires_at", "console_revoked_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_revoked_sessions_expires_at", "console_revoked_sessions")
    op.drop_table("console_revoked_sessions")
