"""Console sessions: a signed, expiring cookie naming the admin key that signed in, and its CSRF token.

The cookie holds the admin key's id (never the key), a random CSRF token and the time it was issued,
signed with `itsdangerous` under the console secret (`LORAMUX_CONSOLE_SECRET`; a random one per process when
unset, so sessions end at a restart). It is HttpOnly, SameSite=Strict, `Secure` over HTTPS, and expires
after `LORAMUX_CONSOLE_SESSION_S`. Every request re-checks that the admin key is still live, so a revoked
key ends its sessions at once. A form (or a fetch with the `X-CSRF-Token` header) must carry the session's
token: a cross-site form cannot read it.
"""
from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

COOKIE = "loramux_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class ConsoleSession:
    admin_key_id: str
    csrf: str


class SessionSigner:
    def __init__(self, secret: str | None, max_age_s: int):
        self.max_age_s = max_age_s
        self._serializer = URLSafeTimedSerializer(secret or secrets.token_urlsafe(32), salt="loramux-console")

    def issue(self, admin_key_id: str) -> tuple[str, ConsoleSession]:
        session = ConsoleSession(admin_key_id, secrets.token_urlsafe(24))
        return self._serializer.dumps({"k": session.admin_key_id, "c": session.csrf}), session

    def read(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie holds, or None when it is missing, forged or expired."""
        if not cookie:
            return None
        try:
            data = self._serializer.loads(cookie, max_age=self.max_age_s)
        except (BadSignature, SignatureExpired):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("k"), str) or not isinstance(data.get("c"), str):
            return None
        return ConsoleSession(data["k"], data["c"])


def csrf_matches(session: ConsoleSession, presented: str | None) -> bool:
    return bool(presented) and hmac.compare_digest(session.csrf.encode(), str(presented).encode())


def cookie_options(max_age_s: int, secure: bool) -> dict:
    return {"key": COOKIE, "max_age": max_age_s, "httponly": True, "samesite": "strict", "secure": secure,
            "path": "/console"}
