"""Tenants, their API keys and the tenant tiers: what the admin API, the console and `loramux tenants` /
`loramux keys` do, in one place. A tenant is named by its id (`tn_...`) or its name everywhere."""
from __future__ import annotations

from dataclasses import dataclass

from loramux.tenancy.tenants import KeyInfo, Tenancy, TenancyError, TenantInfo, TierInfo


@dataclass(frozen=True)
class IssuedKey:
    """A key just made: `key` is the raw secret, shown to its caller once and never stored. `revoked`: the
    key it replaced (rotation)."""
    id: str
    key: str
    prefix: str
    revoked: KeyInfo | None = None


def create_tenant(tenancy: Tenancy, name: str, tier: str = "standard") -> TenantInfo:
    """A new tenant on `tier` (TenantExistsError when the name is taken, UnknownTierError for a bad tier)."""
    if not name:
        raise TenancyError("a tenant needs a name")
    return tenancy.create_tenant(name, tier)


def list_tenants(tenancy: Tenancy) -> list[TenantInfo]:
    return tenancy.list_tenants()


def get_tenant(tenancy: Tenancy, tenant_ref: str) -> TenantInfo:
    """A tenant by id or name (TenantNotFoundError)."""
    return tenancy.tenant(tenant_ref)


def update_tenant(tenancy: Tenancy, tenant_ref: str, tier: str | None = None, status: str | None = None,
                  fallback: str | None = None) -> TenantInfo:
    """Change what is given (None keeps the current value; fallback "" clears it)."""
    return tenancy.set_tenant(tenancy.tenant(tenant_ref).id, tier=tier, status=status, fallback=fallback)


def issue_key(tenancy: Tenancy, tenant_ref: str) -> IssuedKey:
    info, raw = tenancy.create_key(tenancy.tenant(tenant_ref).id)
    return IssuedKey(info.id, raw, info.prefix)


def rotate_key(tenancy: Tenancy, tenant_ref: str, key_id: str) -> IssuedKey:
    """A new key replaces `key_id`, which is revoked at once (KeyNotFoundError when it is not the tenant's)."""
    info, raw, old = tenancy.rotate_key(tenancy.tenant(tenant_ref).id, key_id)
    return IssuedKey(info.id, raw, info.prefix, revoked=old)


def list_keys(tenancy: Tenancy, tenant_ref: str) -> list[KeyInfo]:
    return tenancy.list_keys(tenancy.tenant(tenant_ref).id)


def revoke_key(tenancy: Tenancy, tenant_ref: str, key_id: str) -> KeyInfo:
    return tenancy.revoke_key(tenancy.tenant(tenant_ref).id, key_id)


def list_tiers(tenancy: Tenancy) -> list[TierInfo]:
    return tenancy.tiers()


def put_tier(tenancy: Tenancy, tier: TierInfo) -> TierInfo:
    """Create or replace a tier (0 = unlimited for the per-minute and concurrency limits)."""
    return tenancy.upsert_tier(tier)
