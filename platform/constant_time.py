"""Comparing secrets (keys, CSRF tokens) without leaking where they differ, on any text a client sends."""
from __future__ import annotations

import hmac


def same_secret(expected: str, presented: str | None) -> bool:
    """Constant-time equality on the UTF-8 bytes: `hmac.compare_digest` raises on non-ASCII `str` (a 500
    from hostile input); lone surrogates are encoded as they are rather than raising."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8", "surrogatepass"), presented.encode("utf-8", "surrogatepass"))
