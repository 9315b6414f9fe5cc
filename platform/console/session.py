"""Console sessions: a signed, expiring cookie naming the admin key that signed in, and its CSRF token.

The cookie holds the admin key's id (never the key), a random session id, a random CSRF token and the
time it was issued, signed with `itsdangerous` under the console secret (`LORAMUX_CONSOLE_SECRET`; a random
one per process when unset, so sessions end at a restart). It is HttpOnly, SameSite=Strict, `Secure` as
`LORAMUX_CONSOLE_SECURE_COOKIES` says (by default over HTTPS, a trusted proxy's X-Forwarded-Proto
included), and expires after `LORAMUX_CONSOLE_SESSION_S`. Every request re-checks that the admin key is
still live, so a revoked key ends its sessions at once, and that the session was not signed out
(`loramux.console.revocations`). A form (or a fetch with the `X-CSRF-Token` header) must carry the
session's token: a cross-site form cannot read it.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

from loramux.constant_time import same_secret

COOKIE = "loramux_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class ConsoleSession:
    admin_key_id: str
    csrf: str
    session_id: str


class SessionSigner:
    def __init__(self, secret: str | None, max_age_s: int):
        self.max_age_s = max_age_s
        self._serializer = URLSafeTimedSerializer(secret or secrets.token_urlsafe(32), salt="loramux-console")

    def issue(self, admin_key_id: str) -> tuple[str, ConsoleSession]:
        session = ConsoleSession(admin_key_id, secrets.token_urlsafe(24), secrets.token_urlsafe(24))
        return self._serializer.dumps({"k": session.admin_key_id, "c": session.csrf, "s": session.session_id}), session

    def read(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie holds, or None when it is missing, forged or expired."""
        if not cookie:
            return None
        try:
            data = self._serializer.loads(cookie, max_age=self.max_age_s)
        except (BadSignature, SignatureExpired):
            return None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("k", "c", "s")):
            return None  # a cookie from before session ids (or forged): sign in again
        return ConsoleSession(data["k"], data["c"], data["s"])


def csrf_matches(session: ConsoleSession, presented: str | None) -> bool:
    return bool(presented) and same_secret(session.csrf, str(presented))


def secure_cookies(setting: str, scheme: str) -> bool:
    """Whether cookies get `Secure`: `console_secure_cookies` ("auto", "always", "never") and the scheme the
    client used (`loramux.server.http.forwarded.request_scheme`)."""
    return setting == "always" or (setting == "auto" and scheme == "https")


def cookie_options(max_age_s: int, secure: bool) -> dict:
    return {"key": COOKIE, "max_age": max_age_s, "httponly": True, "samesite": "strict", "secure": secure,
            "path": "/console"}
