"""Admin keys: operators' credentials for /admin, stored as sha256 like tenant keys but with their own
prefix (`lmxa-`) and table, so neither kind of key is ever accepted where the other belongs."""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from loramux.db import AdminKey, Database
from loramux.db.models import utcnow
from loramux.tenancy import hash_key

ADMIN_KEY_PREFIX = "lmxa-"
VISIBLE_CHARS = 13  # "lmxa-" + 8 characters


@dataclass(frozen=True)
class AdminKeyInfo:
    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


def _info(k: AdminKey) -> AdminKeyInfo:
    return AdminKeyInfo(k.id, k.name, k.prefix, k.created_at, k.revoked_at)


class AdminKeyError(ValueError):
    pass


class AdminKeys:
    def __init__(self, db: Database, cache_ttl_s: float = 5.0):
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, AdminKeyInfo | None]] = {}
        self._lock = threading.Lock()

    def create(self, name: str = "") -> tuple[AdminKeyInfo, str]:
        """A new admin key; returns (info, raw key). Only the hash is stored."""
        return self._store(ADMIN_KEY_PREFIX + secrets.token_urlsafe(32), name)

    def ensure(self, raw: str, name: str = "LORAMUX_ADMIN_KEY") -> AdminKeyInfo:
        """Register an operator-chosen key (from the environment) unless it is already known."""
        if not raw.startswith(ADMIN_KEY_PREFIX) or len(raw) < len(ADMIN_KEY_PREFIX) + 24:
            raise AdminKeyError(f"LORAMUX_ADMIN_KEY must start with {ADMIN_KEY_PREFIX!r} and have at least 24 more "
                                "characters (e.g. `loramux admin create-key` makes one)")
        with self.db.session() as s:
            existing = s.scalar(select(AdminKey).where(AdminKey.key_hash == hash_key(raw)))
            if existing is not None:
                return _info(existing)
        return self._store(raw, name)[0]

    def _store(self, raw: str, name: str) -> tuple[AdminKeyInfo, str]:
        with self.db.session() as s:
            key = AdminKey(name=name, prefix=raw[:VISIBLE_CHARS], key_hash=hash_key(raw))
            s.add(key)
            s.flush()
            return _info(key), raw

    def list(self) -> list[AdminKeyInfo]:
        with self.db.session() as s:
            return [_info(k) for k in s.scalars(select(AdminKey).order_by(AdminKey.created_at))]

    def revoke(self, key_id: str) -> AdminKeyInfo:
        with self.db.session() as s:
            key = s.get(AdminKey, key_id)
            if key is None:
                raise AdminKeyError(f"admin key {key_id!r} not found")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            info = _info(key)
        with self._lock:
            self._cache.clear()
        return info

    def authenticate(self, raw: str) -> AdminKeyInfo | None:
        if not raw.startswith(ADMIN_KEY_PREFIX) or len(raw) > 128:
            return None
        digest, now = hash_key(raw), time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
        with self.db.session() as s:
            key = s.scalar(select(AdminKey).where(AdminKey.key_hash == digest, AdminKey.revoked_at.is_(None)))
            info = _info(key) if key is not None else None
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, info)
        return info
