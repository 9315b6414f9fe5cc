"""Tenants, tiers and API keys: data access free of HTTP types.

A key looks like `lmx-<43 url-safe chars>` (256 random bits). Only its sha256 is stored, with a short
visible prefix; the raw key is returned once, at creation. `authenticate` turns a raw key into the
tenant's context (tier limits included) and caches the answer for a few seconds, so a request costs no
SQL round trip while revocations and tier changes still take effect quickly.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from loramux.db import ApiKey, Database, Tenant, Tier
from loramux.db.models import utcnow

KEY_PREFIX = "lmx-"
VISIBLE_CHARS = 12  # "lmx-" + 8 characters


class TenancyError(Exception):
    """Base of tenancy errors; messages are safe to show."""


class UnknownTierError(TenancyError, ValueError):
    pass


class TenantLookupError(TenancyError, LookupError):
    pass


@dataclass(frozen=True)
class TierInfo:
    name: str
    priority: int
    requests_per_min: int
    tokens_per_min: int
    max_concurrent: int
    default_timeout_s: float
    max_timeout_s: float


@dataclass(frozen=True)
class TenantContext:
    """Who is calling: resolved from an API key for every tenant request."""

    tenant_id: str
    tenant_name: str
    status: str
    key_id: str
    key_prefix: str
    tier: TierInfo
    fallback: str  # "none", "base" or an adapter reference

    @property
    def active(self) -> bool:
        return self.status == "active"


@dataclass(frozen=True)
class KeyInfo:
    id: str
    tenant_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def _tier_info(t: Tier) -> TierInfo:
    return TierInfo(t.name, t.priority, t.requests_per_min, t.tokens_per_min, t.max_concurrent,
                    t.default_timeout_s, t.max_timeout_s)


def _key_info(k: ApiKey) -> KeyInfo:
    return KeyInfo(k.id, k.tenant_id, k.prefix, k.created_at, k.revoked_at)


class Tenancy:
    def __init__(self, db: Database, cache_ttl_s: float = 5.0):
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, TenantContext | None]] = {}
        self._lock = threading.Lock()

    # -- tiers -----------------------------------------------------------------------------------
    def tiers(self) -> list[TierInfo]:
        with self.db.session() as s:
            return [_tier_info(t) for t in s.scalars(select(Tier).order_by(Tier.priority))]

    def tier(self, name: str) -> TierInfo:
        with self.db.session() as s:
            tier = s.get(Tier, name)
            if tier is None:
                known = ", ".join(t.name for t in s.scalars(select(Tier).order_by(Tier.priority)))
                raise UnknownTierError(f"unknown tier {name!r}; tiers: {known}")
            return _tier_info(tier)

    def upsert_tier(self, info: TierInfo) -> TierInfo:
        if info.max_timeout_s < info.default_timeout_s or info.default_timeout_s <= 0:
            raise TenancyError("timeouts must satisfy 0 < default_timeout_s <= max_timeout_s")
        if min(info.requests_per_min, info.tokens_per_min, info.max_concurrent) < 0:
            raise TenancyError("limits must be >= 0 (0 = unlimited)")
        with self.db.session() as s:
            s.merge(Tier(**info.__dict__))
        self.invalidate()
        return info

    # -- tenants ---------------------------------------------------------------------------------
    def create_tenant(self, name: str, tier: str = "standard") -> Tenant:
        from sqlalchemy.exc import IntegrityError

        from loramux.adapters.registry import TenantExistsError, check_name

        check_name(name, "tenant")
        self.tier(tier)
        try:
            with self.db.session() as s:
                tenant = Tenant(name=name, tier=tier, status="active", fallback="none")
                s.add(tenant)
                s.flush()
                return tenant
        except IntegrityError:
            raise TenantExistsError(f"a tenant named {name!r} already exists") from None

    def list_tenants(self) -> list[Tenant]:
        with self.db.session() as s:
            return list(s.scalars(select(Tenant).order_by(Tenant.created_at)))

    def tenant(self, ref: str) -> Tenant:
        """A tenant row by id or name (detached; read its fields)."""
        with self.db.session() as s:
            tenant = s.get(Tenant, ref) or s.scalar(select(Tenant).where(Tenant.name == ref))
            if tenant is None:
                raise TenantLookupError(f"tenant {ref!r} not found")
            return tenant

    def set_tenant(self, tenant_id: str, *, tier: str | None = None, status: str | None = None,
                   fallback: str | None = None) -> Tenant:
        if tier is not None:
            self.tier(tier)
        if status is not None and status not in ("active", "suspended"):
            raise TenancyError(f"status must be 'active' or 'suspended', got {status!r}")
        with self.db.session() as s:
            tenant = s.get(Tenant, tenant_id)
            if tenant is None:
                raise TenantLookupError(f"tenant {tenant_id!r} not found")
            for field, value in (("tier", tier), ("status", status), ("fallback", fallback)):
                if value is not None:
                    setattr(tenant, field, value)
        self.invalidate()
        return tenant

    # -- keys ------------------------------------------------------------------------------------
    def create_key(self, tenant_ref: str) -> tuple[KeyInfo, str]:
        """A new key for the tenant (id or name); returns (info, raw key). The raw key is not stored."""
        tenant = self.tenant(tenant_ref)
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        with self.db.session() as s:
            key = ApiKey(tenant_id=tenant.id, prefix=raw[:VISIBLE_CHARS], key_hash=hash_key(raw))
            s.add(key)
            s.flush()
            return _key_info(key), raw

    def list_keys(self, tenant_id: str) -> list[KeyInfo]:
        with self.db.session() as s:
            return [_key_info(k) for k in s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)
                                                    .order_by(ApiKey.created_at))]

    def revoke_key(self, tenant_id: str, key_id: str) -> KeyInfo:
        with self.db.session() as s:
            key = s.get(ApiKey, key_id)
            if key is None or key.tenant_id != tenant_id:
                raise TenantLookupError(f"key {key_id!r} not found for this tenant")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            info = _key_info(key)
        self.invalidate()
        return info

    # -- authentication --------------------------------------------------------------------------
    def authenticate(self, raw: str) -> TenantContext | None:
        """The caller's context for a raw key, or None for an unknown or revoked key."""
        if not raw.startswith(KEY_PREFIX) or len(raw) > 128:
            return None
        digest = hash_key(raw)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
        context = self._lookup(digest)
        with self._lock:
            if len(self._cache) > 10_000:  # bounded: unknown keys must not grow it forever
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, context)
        return context

    def _lookup(self, digest: str) -> TenantContext | None:
        with self.db.session() as s:
            row = s.execute(select(ApiKey, Tenant, Tier).join(Tenant, Tenant.id == ApiKey.tenant_id)
                            .join(Tier, Tier.name == Tenant.tier, isouter=True)
                            .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))).first()
            if row is None:
                return None
            key, tenant, tier = row
            tier_info = _tier_info(tier) if tier is not None else TierInfo(tenant.tier, 0, 0, 0, 0, 60.0, 60.0)
            return TenantContext(tenant.id, tenant.name, tenant.status, key.id, key.prefix, tier_info,
                                 tenant.fallback)

    def invalidate(self) -> None:
        with self._lock:
            self._cache.clear()
