"""Operators' admin keys (`lmxa-...`): what `/admin/keys` and `loramux admin create-key` do."""
from __future__ import annotations

from loramux.services.tenants import IssuedKey
from loramux.tenancy.admin_keys import AdminKeyInfo, AdminKeys


class SelfRevocationError(ValueError):
    """An admin key asked to revoke itself: the caller would lock itself out mid-request."""


def create_admin_key(admin_keys: AdminKeys, name: str = "") -> IssuedKey:
    info, raw = admin_keys.create(name)
    return IssuedKey(info.id, raw, info.prefix)


def list_admin_keys(admin_keys: AdminKeys) -> list[AdminKeyInfo]:
    return admin_keys.list()


def revoke_admin_key(admin_keys: AdminKeys, key_id: str, acting_key_id: str | None) -> AdminKeyInfo:
    """Revoke `key_id` (AdminKeyError when unknown); the key making the call (`acting_key_id`) cannot."""
    if key_id == acting_key_id:
        raise SelfRevocationError("an admin key cannot revoke itself; use another admin key")
    return admin_keys.revoke(key_id)
