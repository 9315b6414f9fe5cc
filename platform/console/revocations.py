"""Signed-out console sessions, kept in the database until their cookies would have expired anyway.

A signed cookie cannot be taken back, so sign-out records the session's id and every console request
checks it. The set lives in the shared database, not in memory, so a session signed out through one
ingress replica is refused by all of them. Rows are purged once expired: the table holds at most the
sessions signed out within one `console_session_s`. Data access only, free of HTTP types.
"""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete

from loramux.db import Database
from loramux.db.models import RevokedConsoleSession, utcnow


class SessionRevocations:
    def __init__(self, db: Database):
        self.db = db

    def revoke(self, session_id: str, lifetime_s: float) -> None:
        """Refuse `session_id` from now on (for `lifetime_s`, the longest its cookie could still be valid)."""
        now = utcnow()
        with self.db.session() as s:
            s.execute(delete(RevokedConsoleSession).where(RevokedConsoleSession.expires_at < now))
            if s.get(RevokedConsoleSession, session_id) is None:
                s.add(RevokedConsoleSession(session_id=session_id, expires_at=now + timedelta(seconds=lifetime_s)))

    def is_revoked(self, session_id: str) -> bool:
        with self.db.session() as s:
            return s.get(RevokedConsoleSession, session_id) is not None
