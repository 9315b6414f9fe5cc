"""Admin keys: operators' credentials for /admin, stored as sha256 like tenant keys but with their own
prefix (`lmxa-`) and table, so neither kind of key is ever accepted where the other belongs."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from loramux.db import AdminKey, Database
from loramux.db.models import utcnow
from loramux.tenancy.key_cache import KeyCache, hash_key

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


class AdminKeyError(LookupError):
    """An unknown admin key id; the message is safe to show."""


class AdminKeyFormatError(ValueError):
    """A configured admin key (LORAMUX_ADMIN_KEY) that does not have an admin key's form."""


def check_admin_key_format(raw: str) -> str:
    """Raise AdminKeyFormatError unless `raw` has an admin key's form (prefix and enough random characters)."""
    if not raw.startswith(ADMIN_KEY_PREFIX) or not 24 <= len(raw) - len(ADMIN_KEY_PREFIX) <= 120:
        raise AdminKeyFormatError(f"LORAMUX_ADMIN_KEY must start with {ADMIN_KEY_PREFIX!r} followed by 24 to 120 "
                                  "characters; `loramux admin create-key` makes one")
    return raw


class AdminKeys:
    def __init__(self, db: Database, cache_ttl_s: float = 5.0):
        self.db = db
        self._keys: KeyCache[AdminKeyInfo | None] = KeyCache(cache_ttl_s)

    def create(self, name: str = "") -> tuple[AdminKeyInfo, str]:
        """A new admin key; returns (info, raw key). Only the hash is stored."""
        return self._store(ADMIN_KEY_PREFIX + secrets.token_urlsafe(32), name)

    def ensure(self, raw: str, name: str = "LORAMUX_ADMIN_KEY") -> AdminKeyInfo:
        """Register an operator-chosen key (from the environment) unless it is already known."""
        check_admin_key_format(raw)
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
        self._keys.invalidate()
        return info

    def live(self, key_id: str) -> AdminKeyInfo | None:
        """The admin key with this id if it is not revoked (a console session checks it on every page)."""
        with self.db.session() as s:
            key = s.get(AdminKey, key_id)
            return _info(key) if key is not None and key.revoked_at is None else None

    def authenticate(self, raw: str) -> AdminKeyInfo | None:
        """The admin key's info for a raw key, or None for an unknown or revoked one."""
        return self._keys.authenticate(raw, ADMIN_KEY_PREFIX, self._lookup)

    def _lookup(self, digest: str) -> AdminKeyInfo | None:
        with self.db.session() as s:
            key = s.scalar(select(AdminKey).where(AdminKey.key_hash == digest, AdminKey.revoked_at.is_(None)))
            return _info(key) if key is not None else None
