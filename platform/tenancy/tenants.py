"""Tenants, tiers and API keys: the one owner of these concepts. Data access only, free of HTTP types.

Everything returned is a frozen DTO (safe to pass between threads and to serialise). A key looks like
`lmx-<43 url-safe chars>` (256 random bits). Only its sha256 is stored, with a short visible prefix; the
raw key is returned once, at creation. `authenticate` turns a raw key into the tenant's context (tier
limits included) and caches the answer for a few seconds, so a request costs no SQL round trip while
revocations and tier changes still take effect quickly.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from loramux.db import ApiKey, Database, Tenant, Tier
from loramux.db.models import utcnow
from loramux.names import check_name
from loramux.tenancy.key_cache import KeyCache, hash_key

KEY_PREFIX = "lmx-"
VISIBLE_CHARS = 12  # "lmx-" + 8 characters
TENANT_STATUSES = ("active", "suspended")


class TenancyError(Exception):
    """Base of tenancy errors (a request that cannot be done as asked); messages are safe to show."""


class UnknownTierError(TenancyError, ValueError):
    pass


class TenantNotFoundError(TenancyError, LookupError):
    pass


class KeyNotFoundError(TenancyError, LookupError):
    pass


class TenantExistsError(TenancyError, ValueError):
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
    max_choices: int = 8  # the most choices (OpenAI's `n`) one request may ask for
    max_adapter_head_bytes: int = 0  # trained heads / embeddings in an upload; 0 = only the server's limit
    max_fanout: int = 8  # the most adapters one fan-out request (`models`) may name


@dataclass(frozen=True)
class TenantInfo:
    id: str
    name: str
    tier: str
    status: str
    fallback: str  # "none", "base" or an adapter reference
    created_at: datetime


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


def _tier_info(t: Tier) -> TierInfo:
    return TierInfo(t.name, t.priority, t.requests_per_min, t.tokens_per_min, t.max_concurrent,
                    t.default_timeout_s, t.max_timeout_s, t.max_choices, t.max_adapter_head_bytes, t.max_fanout)


def _tenant_info(t: Tenant) -> TenantInfo:
    return TenantInfo(t.id, t.name, t.tier, t.status, t.fallback, t.created_at)


def _key_info(k: ApiKey) -> KeyInfo:
    return KeyInfo(k.id, k.tenant_id, k.prefix, k.created_at, k.revoked_at)


class Tenancy:
    def __init__(self, db: Database, cache_ttl_s: float = 5.0):
        self.db = db
        self._keys: KeyCache[TenantContext | None] = KeyCache(cache_ttl_s)

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
        check_name(info.name, "tier")
        if info.max_timeout_s < info.default_timeout_s or info.default_timeout_s <= 0:
            raise TenancyError("timeouts must satisfy 0 < default_timeout_s <= max_timeout_s")
        if min(info.requests_per_min, info.tokens_per_min, info.max_concurrent) < 0:
            raise TenancyError("limits must be >= 0 (0 = unlimited)")
        if not 1 <= info.max_choices <= 128:
            raise TenancyError("max_choices must be in [1, 128]")
        if not 1 <= info.max_fanout <= 128:
            raise TenancyError("max_fanout must be in [1, 128]")
        if info.max_adapter_head_bytes < 0:
            raise TenancyError("max_adapter_head_bytes must be >= 0 (0 = only the server's limit)")
        with self.db.session() as s:
            s.merge(Tier(**info.__dict__))
        self.invalidate()
        return info

    # -- tenants ---------------------------------------------------------------------------------
    def create_tenant(self, name: str, tier: str = "standard") -> TenantInfo:
        check_name(name, "tenant")
        check_name(tier, "tier")
        self.tier(tier)
        try:
            with self.db.session() as s:
                tenant = Tenant(name=name, tier=tier, status="active", fallback="none")
                s.add(tenant)
                s.flush()
                return _tenant_info(tenant)
        except IntegrityError:
            raise TenantExistsError(f"a tenant named {name!r} already exists") from None

    def ensure_tenant(self, name: str, tier: str = "standard") -> tuple[TenantInfo, bool]:
        """The tenant called `name`, created with `tier` when missing; returns (tenant, created)."""
        try:
            return self.tenant(name), False
        except TenantNotFoundError:
            pass
        try:
            return self.create_tenant(name, tier), True
        except TenantExistsError:  # created by someone else a moment ago
            return self.tenant(name), False

    def list_tenants(self) -> list[TenantInfo]:
        with self.db.session() as s:
            return [_tenant_info(t) for t in s.scalars(select(Tenant).order_by(Tenant.created_at))]

    def tenant(self, ref: str) -> TenantInfo:
        """A tenant by id (`tn_...`) or name."""
        with self.db.session() as s:
            tenant = s.get(Tenant, ref) or s.scalar(select(Tenant).where(Tenant.name == ref))
            if tenant is None:
                raise TenantNotFoundError(f"tenant {ref!r} not found")
            return _tenant_info(tenant)

    def set_tenant(self, tenant_id: str, *, tier: str | None = None, status: str | None = None,
                   fallback: str | None = None) -> TenantInfo:
        if tier is not None:
            check_name(tier, "tier")
            self.tier(tier)
        if status is not None and status not in TENANT_STATUSES:
            raise TenancyError(f"status must be 'active' or 'suspended', got {status!r}")
        with self.db.session() as s:
            tenant = s.get(Tenant, tenant_id)
            if tenant is None:
                raise TenantNotFoundError(f"tenant {tenant_id!r} not found")
            for field, value in (("tier", tier), ("status", status), ("fallback", fallback)):
                if value is not None:
                    setattr(tenant, field, value)
            s.flush()
            info = _tenant_info(tenant)
        self.invalidate()
        return info

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
                raise KeyNotFoundError(f"key {key_id!r} not found for this tenant")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            info = _key_info(key)
        self.invalidate()
        return info

    def rotate_key(self, tenant_id: str, key_id: str) -> tuple[KeyInfo, str, KeyInfo]:
        """Revoke `key_id` and create its replacement; returns (new info, new raw key, revoked info)."""
        old = self.revoke_key(tenant_id, key_id)
        info, raw = self.create_key(tenant_id)
        return info, raw, old

    # -- authentication --------------------------------------------------------------------------
    def authenticate(self, raw: str) -> TenantContext | None:
        """The caller's context for a raw key, or None for an unknown or revoked key."""
        return self._keys.authenticate(raw, KEY_PREFIX, self._lookup)

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
        """Forget cached key answers (after a revocation, a tier or a tenant change)."""
        self._keys.invalidate()
