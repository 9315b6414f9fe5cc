"""Alert webhook signatures, as Stripe signs its webhooks: `X-Loramux-Timestamp: <unix seconds>` and
`X-Loramux-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>`, with the event id in
`X-Loramux-Event-Id`; `verify_signature` checks them, for receivers and tests."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

EVENT_ID_HEADER = "X-Loramux-Event-Id"
TIMESTAMP_HEADER = "X-Loramux-Timestamp"
SIGNATURE_HEADER = "X-Loramux-Signature"
SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    """A signing secret: `whsec_` and 64 hex digits (256 random bits)."""
    return SECRET_PREFIX + secrets.token_hex(32)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The `X-Loramux-Signature` value of `body` sent at `timestamp`: `v1=<hex HMAC-SHA256>` of
    "<timestamp>.<body>" keyed by `secret`."""
    mac = hmac.new(secret.encode(), str(int(timestamp)).encode() + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def signed_headers(secret: str, event_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The three headers that identify and sign one request carrying `body`."""
    timestamp = int(time.time()) if timestamp is None else int(timestamp)
    return {EVENT_ID_HEADER: event_id, TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: signature(secret, timestamp, body)}


def _header(headers: Any, name: str) -> str | None:
    """A header by name, case-insensitively, from any mapping with `items()` (a dict, httpx's or Starlette's
    headers, http.server's message)."""
    wanted = name.lower()
    for key, value in headers.items():
        if str(key).lower() == wanted:
            return str(value)
    return None


def verify_signature(secret: str, body: bytes | str, headers: Any, tolerance_s: float = 300,
                     now: float | None = None) -> bool:
    """Whether `headers` sign `body` (the raw request body, exactly as received) with `secret`, at a timestamp
    within `tolerance_s` seconds of `now` (unix seconds; default the clock), which refuses replays of old
    requests. `X-Loramux-Signature` may hold several comma-separated `v1=` values; one valid is enough."""
    stamp, signed = _header(headers, TIMESTAMP_HEADER), _header(headers, SIGNATURE_HEADER)
    if not stamp or not signed:
        return False
    try:
        timestamp = int(stamp.strip())
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    raw = body.encode() if isinstance(body, str) else bytes(body)
    expected = signature(secret, timestamp, raw).encode()
    return any(hmac.compare_digest(expected, candidate.strip().encode()) for candidate in signed.split(","))
