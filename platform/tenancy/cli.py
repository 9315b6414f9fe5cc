"""`loramux tenants ...` and `loramux keys ...`: the one command line for tenants and their API keys.

It works on the database directly (LORAMUX_DATABASE_URL), so it also works before the server has ever
started, e.g. to make the first key. `loramux admin tenants|keys` are the same commands under `admin`
(with JSON output, like the rest of `loramux admin`).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import datetime

from loramux.names import InvalidNameError
from loramux.services import tenants as ops
from loramux.settings import Settings
from loramux.tenancy.tenants import Tenancy, TenancyError


def add_tenant_parsers(sub, *, json_output: bool = False) -> None:
    """Add `tenants` and `keys` to the subparsers `sub`; `json_output` fixes JSON output (under `admin`)."""
    t = sub.add_parser("tenants", help="create, list and change tenants (LORAMUX_DATABASE_URL)")
    tsub = t.add_subparsers(dest="tenants_command", required=True)
    tc = tsub.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--tier", default="standard", help="free, standard (default), premium, or a tier added later")
    tsub.add_parser("list", help="list tenants")
    ts = tsub.add_parser("set", help="change a tenant's tier, status or fallback")
    ts.add_argument("tenant", help="tenant name or id")
    ts.add_argument("--tier")
    ts.add_argument("--status", choices=["active", "suspended"])
    ts.add_argument("--fallback", help="when an adapter cannot be loaded: none (503), base, or an adapter name")

    k = sub.add_parser("keys", help="tenant API keys (only hashes are stored; a new key is printed once)")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    ksub.add_parser("create", help="create a key and print it").add_argument("tenant", help="tenant name or id")
    ksub.add_parser("list", help="list a tenant's keys (id and prefix)").add_argument("tenant")
    for name, what in (("revoke", "revoke a key"), ("rotate", "revoke a key and create its replacement")):
        p = ksub.add_parser(name, help=what)
        p.add_argument("tenant")
        p.add_argument("key_id")
    for p in (*tsub.choices.values(), *ksub.choices.values()):
        if json_output:
            p.set_defaults(json=True)
        else:
            p.add_argument("--json", action="store_true", help="print JSON")
    t.set_defaults(func=cmd_tenants)
    k.set_defaults(func=cmd_keys)


def _tenancy(settings: Settings) -> Tenancy:
    from loramux.db import Database

    db = Database(settings.resolved_database_url())
    db.upgrade()
    return Tenancy(db)


def _json(value) -> str:
    def default(v):
        return v.isoformat() if isinstance(v, datetime) else str(v)

    return json.dumps(value, indent=2, default=default)


def cmd_tenants(args, settings: Settings) -> int:
    tenancy = _tenancy(settings)
    try:
        if args.tenants_command == "create":
            t = ops.create_tenant(tenancy, args.name, args.tier)
            print(_json(asdict(t)) if args.json else
                  f"created tenant {t.name} ({t.id}), tier {t.tier}\nnext: loramux keys create {t.name}")
        elif args.tenants_command == "list":
            tenants = ops.list_tenants(tenancy)
            if args.json:
                print(_json({"tenants": [asdict(t) for t in tenants]}))
            for t in tenants if not args.json else ():
                print(f"{t.id}  {t.name:<24} tier={t.tier:<10} status={t.status} fallback={t.fallback}")
        else:
            t = ops.update_tenant(tenancy, args.tenant, tier=args.tier, status=args.status, fallback=args.fallback)
            print(_json(asdict(t)) if args.json else f"{t.name}: tier={t.tier} status={t.status} fallback={t.fallback}")
    except (TenancyError, InvalidNameError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        tenancy.db.dispose()
    return 0


def cmd_keys(args, settings: Settings) -> int:
    tenancy = _tenancy(settings)
    try:
        tenant = ops.get_tenant(tenancy, args.tenant)
        if args.keys_command in ("create", "rotate"):
            issued = (ops.issue_key(tenancy, tenant.id) if args.keys_command == "create"
                      else ops.rotate_key(tenancy, tenant.id, args.key_id))
            revoked = issued.revoked
            if args.json:
                print(_json({"id": issued.id, "key": issued.key, "prefix": issued.prefix,
                             **({"revoked": revoked.id} if revoked else {})}))
            else:
                print(issued.key)
                print(f"key {issued.id} ({issued.prefix}...) for tenant {tenant.name}: shown once, store it now"
                      + (f"; revoked {revoked.id}" if revoked else ""), file=sys.stderr)
        elif args.keys_command == "list":
            keys = ops.list_keys(tenancy, tenant.id)
            if args.json:
                print(_json({"keys": [asdict(k) for k in keys]}))
            for k in keys if not args.json else ():
                state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
                print(f"{k.id}  {k.prefix}...  created {k.created_at:%Y-%m-%d %H:%M}  {state}")
        else:
            info = ops.revoke_key(tenancy, tenant.id, args.key_id)
            print(_json(asdict(info)) if args.json else f"revoked {info.id} ({info.prefix}...)")
    except TenancyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        tenancy.db.dispose()
    return 0
