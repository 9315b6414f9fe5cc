"""`loramux admin ...`: the admin API from the command line (HTTP, with LORAMUX_ADMIN_KEY), plus
`create-key`, which bootstraps an admin key directly in the database, and `tenants`/`keys`, which are
`loramux tenants|keys` (see loramux.tenancy.cli) with JSON output."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import quote

from loramux.settings import Settings
from loramux.tenancy.cli import add_tenant_parsers, cmd_keys, cmd_tenants


def add_parser(sub) -> None:
    a = sub.add_parser("admin", help="operate the platform: tenants, keys, adapters, Medusa heads, tiers, prices, "
                                     "billing, budgets")
    a.add_argument("--url", help="server URL (default http://LORAMUX_HOST:LORAMUX_PORT)")
    a.add_argument("--key", help="admin key (default: $LORAMUX_ADMIN_KEY)")
    asub = a.add_subparsers(dest="admin_command", required=True)

    ck = asub.add_parser("create-key", help="create an admin key in the database and print it (shown once)")
    ck.add_argument("--name", default="")

    add_tenant_parsers(asub, json_output=True)

    ad = asub.add_parser("adapters", help="adapters").add_subparsers(dest="action", required=True)
    up = ad.add_parser("upload", help="upload a PEFT adapter directory (with a progress bar)")
    up.add_argument("tenant_id")
    up.add_argument("name")
    up.add_argument("directory")
    up.add_argument("--public", action="store_true")
    up.add_argument("--allow-base-mismatch", action="store_true",
                    help="accept a base_model_name_or_path that names another model (the shapes are still checked)")
    mg = ad.add_parser("merge", help="merge adapters into a new one (or a new version) with PEFT's "
                                     "add_weighted_adapter")
    mg.add_argument("tenant_id", help="the new adapter's owner (an id or a name)")
    mg.add_argument("name", help="the new adapter's name (an existing one gets a new version)")
    mg.add_argument("components", nargs="+", metavar="ADAPTER[@VERSION][=WEIGHT]",
                    help="an adapter id or name the tenant can use, optionally @version and =weight (default 1)")
    mg.add_argument("--method", required=True, help="cat, linear, ties, dare_linear, dare_ties or svd")
    mg.add_argument("--density", type=float, help="ties, dare_*: the fraction of entries kept, in (0, 1]")
    mg.add_argument("--majority-sign-method", help="ties, dare_ties: total (default) or frequency")
    mg.add_argument("--seed", type=int, help="dare_*: the random seed (default: one the server picks and records)")
    mg.add_argument("--svd-rank", type=int, help="svd: the merged rank (default: the largest component rank)")
    mg.add_argument("--svd-clamp", type=float, help="svd: clamp to this quantile")
    mg.add_argument("--public", action="store_true")
    al = ad.add_parser("list")
    al.add_argument("--tenant-id")
    for name in ("show", "delete", "warm", "pin", "unpin"):
        ad.add_parser(name).add_argument("adapter_id")

    md = asub.add_parser("medusa", help="Medusa speculative-decoding heads").add_subparsers(dest="action",
                                                                                         required=True)
    mu = md.add_parser("upload", help="upload a heads directory (medusa_config.json + medusa_heads.safetensors) "
                                      "for the base model, or for an adapter version with --adapter")
    mu.add_argument("directory")
    mu.add_argument("--adapter", help="an adapter name (with --tenant-id) or id (ad_...); default: the base model")
    mu.add_argument("--tenant-id", help="the adapter's owner (an id or a name)")
    mu.add_argument("--version", type=int, help="the adapter version (default: its latest)")
    ml = md.add_parser("list")
    ml.add_argument("--adapter")
    ml.add_argument("--tenant-id")
    ml.add_argument("--base", action="store_true", help="only the base model's heads")
    ml.add_argument("--include-deleted", action="store_true", help="deleted and replaced heads too")
    md.add_parser("delete").add_argument("heads_id")

    b = asub.add_parser("billing", help="billing").add_subparsers(dest="action", required=True)
    for name in ("summary", "export"):
        p = b.add_parser(name)
        p.add_argument("--tenant-id")
        p.add_argument("--start", help="ISO 8601 date or time, inclusive")
        p.add_argument("--end", help="ISO 8601 date or time, exclusive")
        if name == "export":
            p.add_argument("--format", choices=["csv", "jsonl", "parquet"], default="csv")
            p.add_argument("--out", help="file to write (default: stdout)")
    sp = b.add_parser("spend", help="spend per UTC day, week (from Monday) or month and per tenant, adapter, key, "
                                    "end user or tag (a request counts under each of its tags)")
    sp.add_argument("--group-by", default="tenant", help="tenant (default), adapter, key, user or tag")
    sp.add_argument("--period", default="day", help="day (default), week or month")
    sp.add_argument("--tenant", "--tenant-id", dest="tenant_id", help="only this tenant (an id or a name)")
    sp.add_argument("--start", help="ISO 8601 date or time, inclusive")
    sp.add_argument("--end", help="ISO 8601 date or time, exclusive")

    bu = asub.add_parser("budgets", help="spend limits in USD per period: of a tenant, or of one of its keys, end "
                                         "users or tags").add_subparsers(dest="action", required=True)
    bl = bu.add_parser("list", help="every budget, or one tenant's, in its current period")
    bl.add_argument("tenant", metavar="TENANT", nargs="?", help="a tenant id or name (default: all tenants)")
    bg = bu.add_parser("get", help="one budget in its current period")
    bs = bu.add_parser("set", help="create or replace a budget")
    bd = bu.add_parser("delete", help="remove a budget")
    for p in (bg, bs, bd):
        p.add_argument("tenant", metavar="TENANT", help="a tenant id or name")
        if p is bs:
            p.add_argument("limit_usd", metavar="LIMIT_USD", help="the limit in USD, a decimal such as 500.00")
            p.add_argument("--period", required=True, help="day, week, month (reset at 00:00 UTC) or total (never)")
            hard = p.add_mutually_exclusive_group()
            hard.add_argument("--hard", dest="hard", action="store_true", default=True,
                              help="refuse requests that would pass the limit (the default)")
            hard.add_argument("--soft", dest="hard", action="store_false", help="only alert")
            p.add_argument("--alert-at", help="comma-separated fractions of the limit whose crossing sends a webhook "
                                              "event (default 0.5,0.8,1)")
        subject = p.add_mutually_exclusive_group()
        # dest key_id: `key` is the admin key given before the command
        subject.add_argument("--key", dest="key_id", help="the budget of this API key (its id) instead of the tenant's")
        subject.add_argument("--user", help="the budget of this end user (the requests' `user`)")
        subject.add_argument("--tag", help="the budget of this tag")

    pr = asub.add_parser("prices", help="prices (USD per 1M tokens)").add_subparsers(dest="action", required=True)
    pr.add_parser("list")
    ps = pr.add_parser("set")
    ps.add_argument("--input", required=True)
    ps.add_argument("--cached-input", required=True)
    ps.add_argument("--output", required=True)
    ps.add_argument("--adapter-id")
    ps.add_argument("--tier")
    ps.add_argument("--effective-from", help="ISO 8601 with timezone (default: now)")
    for p in asub.choices.values():
        p.set_defaults(func=run)


def run(args, settings: Settings) -> int:
    if args.admin_command == "tenants":
        return cmd_tenants(args, settings)
    if args.admin_command == "keys":
        return cmd_keys(args, settings)
    if args.admin_command == "create-key":
        from loramux.db import Database
        from loramux.services.admin_keys import create_admin_key
        from loramux.tenancy.admin_keys import AdminKeys

        db = Database(settings.resolved_database_url())
        db.upgrade()
        issued = create_admin_key(AdminKeys(db), args.name)
        db.dispose()
        print(issued.key)
        print(f"admin key {issued.id} ({issued.prefix}...): shown once, store it now"
              " (e.g. export LORAMUX_ADMIN_KEY=...)",
              file=sys.stderr)
        return 0
    key = args.key or settings.admin_key
    if not key:
        print("error: give --key or set LORAMUX_ADMIN_KEY (create one with `loramux admin create-key`)",
              file=sys.stderr)
        return 2
    import httpx

    url = (args.url or f"http://{settings.host}:{settings.port}").rstrip("/")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        try:
            return _dispatch(client, args)
        except httpx.HTTPError as exc:
            print(f"error: cannot reach {url}: {exc}", file=sys.stderr)
            return 2


def _show(resp) -> int:
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except Exception:  # noqa: BLE001
            message = resp.text
        print(f"error ({resp.status_code}): {message}", file=sys.stderr)
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0


def _dispatch(client, args) -> int:
    cmd, action = args.admin_command, args.action
    if cmd == "adapters":
        if action == "upload":
            return _upload(client, args)
        if action == "merge":
            return _merge(client, args)
        if action == "list":
            return _show(client.get("/admin/adapters", params={"tenant_id": args.tenant_id} if args.tenant_id else {}))
        path = f"/admin/adapters/{args.adapter_id}"
        return _show({"show": lambda: client.get(path), "delete": lambda: client.delete(path),
                      "warm": lambda: client.post(f"{path}/warm"), "pin": lambda: client.post(f"{path}/pin"),
                      "unpin": lambda: client.delete(f"{path}/pin")}[action]())
    if cmd == "medusa":
        if action == "upload":
            return _upload_medusa(client, args)
        if action == "list":
            params = {"adapter": args.adapter, "tenant_id": args.tenant_id,
                      "base": "true" if args.base else None,
                      "include_deleted": "true" if args.include_deleted else None}
            return _show(client.get("/admin/medusa", params={k: v for k, v in params.items() if v}))
        return _show(client.delete(f"/admin/medusa/{args.heads_id}"))
    if cmd == "prices":
        if action == "list":
            return _show(client.get("/admin/prices"))
        body = {"input_per_mtok": args.input, "cached_input_per_mtok": args.cached_input,
                "output_per_mtok": args.output, "adapter_id": args.adapter_id, "tier": args.tier,
                "effective_from": args.effective_from}
        return _show(client.post("/admin/prices", json={k: v for k, v in body.items() if v is not None}))
    if cmd == "budgets":
        return _budgets(client, args)
    params = {k: v for k, v in {"tenant_id": args.tenant_id, "start": args.start, "end": args.end}.items() if v}
    if action == "summary":
        return _show(client.get("/admin/billing/summary", params=params))
    if action == "spend":
        return _show(client.get("/admin/billing/spend",
                                params={**params, "group_by": args.group_by, "period": args.period}))
    params["format"] = args.format
    with client.stream("GET", "/admin/billing/export", params=params) as resp:
        if resp.status_code >= 400:
            resp.read()
            return _show(resp)
        out = open(args.out, "wb") if args.out else sys.stdout.buffer
        try:
            for chunk in resp.iter_bytes():
                out.write(chunk)
        finally:
            if args.out:
                out.close()
    return 0


def budget_path(tenant: str, key: str | None = None, user: str | None = None, tag: str | None = None) -> str:
    """The admin API path of a tenant's budget, or of its key's, end user's or tag's (each part escaped)."""
    path = f"/admin/tenants/{quote(tenant, safe='')}"
    for kind, subject in (("keys", key), ("users", user), ("tags", tag)):
        if subject is not None:
            return f"{path}/{kind}/{quote(subject, safe='')}/budget"
    return f"{path}/budget"


def _budgets(client, args) -> int:
    if args.action == "list":
        return _show(client.get(f"/admin/tenants/{quote(args.tenant, safe='')}/budgets" if args.tenant
                                else "/admin/budgets"))
    path = budget_path(args.tenant, args.key_id, args.user, args.tag)
    if args.action == "get":
        return _show(client.get(path))
    if args.action == "set":
        body: dict = {"limit_usd": args.limit_usd, "period": args.period, "hard": args.hard}
        if args.alert_at is not None:
            body["alert_at"] = [a.strip() for a in args.alert_at.split(",") if a.strip()]
        return _show(client.put(path, json=body))
    resp = client.delete(path)
    if resp.status_code == 204:
        subjects = {"key": args.key_id, "user": args.user, "tag": args.tag}
        scope = next((s for s, v in subjects.items() if v is not None), "tenant")
        print(json.dumps({"tenant": args.tenant, "scope": scope, "subject": subjects.get(scope), "deleted": True},
                         indent=2))
        return 0
    return _show(resp)


def _upload(client, args) -> int:
    directory = Path(args.directory)
    parts = {"adapter_config": directory / "adapter_config.json",
             "adapter_model": directory / "adapter_model.safetensors"}
    fields = {"tenant_id": args.tenant_id, "name": args.name, "visibility": "public" if args.public else "private",
              "allow_base_mismatch": "true" if args.allow_base_mismatch else "false"}
    return _send_files(client, "/admin/adapters", parts, fields, args.name)


def merge_component(text: str) -> dict:
    """`ADAPTER[@VERSION][=WEIGHT]` as a component of POST /admin/adapters/merge (ValueError naming the part)."""
    ref, _, weight = text.partition("=")
    ref, _, version = ref.partition("@")
    component: dict = {"adapter": ref}
    if version:
        if not version.isdigit():
            raise ValueError(f"component {text!r}: the version after '@' must be a number")
        component["version"] = int(version)
    if weight:
        try:
            component["weight"] = float(weight)
        except ValueError:
            raise ValueError(f"component {text!r}: the weight after '=' must be a number") from None
    return component


def _merge(client, args) -> int:
    try:
        components = [merge_component(text) for text in args.components]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parameters = {"density": args.density, "majority_sign_method": args.majority_sign_method, "seed": args.seed,
                  "svd_rank": args.svd_rank, "svd_clamp": args.svd_clamp}
    body = {"tenant_id": args.tenant_id, "name": args.name, "method": args.method, "components": components,
            "visibility": "public" if args.public else "private",
            "parameters": {k: v for k, v in parameters.items() if v is not None}}
    return _show(client.post("/admin/adapters/merge", json=body))


def _upload_medusa(client, args) -> int:
    directory = Path(args.directory)
    parts = {"medusa_config": directory / "medusa_config.json",
             "medusa_heads": directory / "medusa_heads.safetensors"}
    fields = {"tenant_id": args.tenant_id, "adapter": args.adapter,
              "version": str(args.version) if args.version is not None else None}
    what = f"Medusa heads for {args.adapter}" if args.adapter else "Medusa heads for the base model"
    return _send_files(client, "/admin/medusa", parts, {k: v for k, v in fields.items() if v}, what)


def _send_files(client, path: str, parts: dict[str, Path], fields: dict, what: str) -> int:
    """POST `parts` (form field -> file) and `fields` as multipart to `path`, with a progress bar."""
    from tqdm import tqdm

    missing = [str(p) for p in parts.values() if not p.is_file()]
    if missing:
        print(f"error: not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    import httpx

    files = {field: (p.name, p.open("rb")) for field, p in parts.items()}
    try:
        request = client.build_request("POST", path, data=fields, files=files)
        body = request.stream
        total = int(request.headers.get("content-length", 0)) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"uploading {what}", file=sys.stderr) as bar:
            def chunks():
                for chunk in body:
                    bar.update(len(chunk))
                    yield chunk

            request = httpx.Request("POST", request.url, headers=request.headers, content=chunks())
            resp = client.send(request)
    finally:
        for _, handle in files.values():
            handle.close()
    return _show(resp)
