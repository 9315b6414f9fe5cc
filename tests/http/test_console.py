"""The operator console's security over HTTP (no browser): sessions, CSRF, cookie flags, keys never shown
twice, and every page rendering for a signed-in operator. tests/system/test_console_browser.py drives it in Chromium."""
from __future__ import annotations

import re

import httpx
import pytest
from itsdangerous import TimestampSigner

from conftest import new_tenant_key, serve_admin_stack
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-console-admin-key-0123456789abcdefghijklmn"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dir, tokenizer):
    yield from serve_admin_stack(tmp_path_factory.mktemp("console"), tiny_dir, tokenizer, ADMIN_KEY)


def sign_in(url: str, key: str = ADMIN_KEY) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=url, follow_redirects=False, timeout=30)
    form = client.get("/console/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    return client, client.post("/console/login", data={"admin_key": key, "csrf_token": token})


def csrf_of(page: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)"', page).group(1)


def console_routes() -> list[tuple[str, str]]:
    """(method, path) of every console route but sign-in, path parameters filled with a missing id."""
    from loramux.console import routes as console

    pages = [(r.path, r.methods) for module in (console.auth, console.tenants, console.adapters, console.prices,
                                               console.usage, console.engine) for r in module.router.routes]
    pages += [(r.path.removeprefix("/console"), r.methods) for r in console.router.routes if hasattr(r, "methods")]
    return [(method, "/console" + re.sub(r"\{[^}]+\}", "x_missing", path)) for path, methods in pages
            for method in sorted(methods) if path != "/login"]


def test_every_console_route_refuses_without_a_session(stack):
    server = stack[0]
    routes = console_routes()
    assert len(routes) >= 20, routes
    for method, path in routes:
        resp = httpx.request(method, server.url + path, follow_redirects=False, timeout=30)
        if method == "GET" and "/data" not in path and "/export" not in path:
            assert resp.status_code == 303 and resp.headers["location"] == "/console/login", (method, path)
        else:
            assert resp.status_code == 401, (method, path, resp.status_code)
        forged = httpx.request(method, server.url + path, cookies={"loramux_console": "forged.value.sig"},
                               follow_redirects=False, timeout=30)
        assert forged.status_code in (303, 401), (method, path)


def test_a_tenant_key_or_a_wrong_key_cannot_sign_in(stack):
    server, tenant_key = stack[0], stack[1]
    for key, status, words in ((tenant_key, 403, "Tenant API keys cannot sign in"),
                               ("lmxa-not-a-real-key-0123456789abcdefghijklmn", 401, "unknown or revoked"),
                               ("", 401, "unknown or revoked")):
        client, resp = sign_in(server.url, key)
        assert resp.status_code == status and words in resp.text
        assert "loramux_console" not in resp.cookies
        assert client.get("/console/tenants").status_code == 303


def test_sign_in_needs_the_forms_csrf_token(stack):
    server = stack[0]
    client = httpx.Client(base_url=server.url, follow_redirects=False, timeout=30)
    client.get("/console/login")
    refused = client.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": "guessed"})
    assert refused.status_code == 403 and "loramux_console" not in refused.cookies
    bare = httpx.post(server.url + "/console/login", data={"admin_key": ADMIN_KEY})  # no cookie, no field
    assert bare.status_code in (403, 422) and "loramux_console" not in bare.cookies


def test_the_session_cookie_is_httponly_strict_scoped_and_expires(stack):
    server = stack[0]
    client, resp = sign_in(server.url)
    assert resp.status_code == 303 and resp.headers["location"] == "/console/tenants"
    cookie = next(h for h in resp.headers.get_list("set-cookie") if h.startswith("loramux_console="))
    flags = cookie.lower()
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console" in flags
    max_age = int(re.search(r"max-age=(\d+)", flags).group(1))
    assert 0 < max_age <= 24 * 3600
    assert ADMIN_KEY not in cookie  # the cookie names the key's id, never the key
    assert client.get("/console/tenants").status_code == 200


def test_an_expired_or_revoked_session_is_refused(stack, monkeypatch):
    server = stack[0]
    services = server.services
    signer = server.app.state.console_signer
    key_info, raw = services.admin_keys.create("short-lived")
    client, resp = sign_in(server.url, raw)
    assert resp.status_code == 303 and client.get("/console/tenants").status_code == 200
    services.admin_keys.revoke(key_info.id)
    assert client.get("/console/tenants").status_code == 303  # a revoked key ends its sessions at once
    client2, _ = sign_in(server.url)
    assert client2.get("/console/tenants").status_code == 200
    # The signature's clock (itsdangerous reads it through get_timestamp) moves past the session's age.
    real_now = TimestampSigner.get_timestamp
    monkeypatch.setattr(TimestampSigner, "get_timestamp", lambda self: real_now(self) + signer.max_age_s + 1)
    assert client2.get("/console/tenants").status_code == 303


def test_forms_without_the_csrf_token_change_nothing(stack):
    server = stack[0]
    client, _ = sign_in(server.url)
    before = len(server.services.tenancy.list_tenants())
    for data in ({"name": "csrf-less"}, {"name": "csrf-wrong", "csrf_token": "nope"}):
        resp = client.post("/console/tenants", data=data)
        assert resp.status_code == 403 and "CSRF" in resp.text
    assert len(server.services.tenancy.list_tenants()) == before
    tenant = server.services.tenancy.tenant("acme")
    key_count = len(server.services.tenancy.list_keys(tenant.id))
    assert client.post(f"/console/tenants/{tenant.id}/keys", data={}).status_code == 403
    assert len(server.services.tenancy.list_keys(tenant.id)) == key_count
    upload = client.post("/console/adapters/upload", data={"tenant_id": tenant.id, "name": "x"},
                         files={"adapter_config": ("adapter_config.json", b"{}")})
    assert upload.status_code == 403


def test_a_new_key_is_shown_once_and_no_page_shows_a_stored_key(stack):
    server = stack[0]
    client, _ = sign_in(server.url)
    page = client.get("/console/tenants")
    created = client.post("/console/tenants", data={"name": "shown-once", "tier": "standard",
                                                    "csrf_token": csrf_of(page.text)}, follow_redirects=True)
    assert created.status_code == 200 and "shown-once" in created.text
    tenant = server.services.tenancy.tenant("shown-once")
    answer = client.post(f"/console/tenants/{tenant.id}/keys", data={"csrf_token": csrf_of(created.text)})
    raw = re.search(r'<p class="secret" id="new-key">([^<]+)</p>', answer.text).group(1)
    assert server.services.tenancy.authenticate(raw).tenant_id == tenant.id
    # Every page afterwards: the raw key (and the stored hash, and the admin key) never appear.
    other_raw = new_tenant_key(server.services, "acme")
    for path in ("/console/tenants", f"/console/tenants/{tenant.id}", "/console/adapters", "/console/prices",
                 "/console/usage", "/console/engine", "/console/engine/data"):
        text = client.get(path).text
        assert raw not in text and other_raw not in text and ADMIN_KEY not in text, path
    assert raw[:12] in client.get(f"/console/tenants/{tenant.id}").text  # the prefix is how keys are told apart


def test_every_page_renders_and_the_upload_reports_the_validators_message(stack, tmp_path):
    server, _, cfg, _ = stack
    client, _ = sign_in(server.url)
    for path in ("/console/tenants", "/console/adapters", "/console/prices", "/console/usage", "/console/engine"):
        resp = client.get(path)
        assert resp.status_code == 200 and "<main" in resp.text and 'aria-current="page"' in resp.text, path
    token = csrf_of(client.get("/console/adapters").text)
    acme = server.services.tenancy.tenant("acme")
    good = write_peft_adapter(tmp_path / "good", cfg, 4, ["q_proj"], seed=3)
    files = {"adapter_config": ("adapter_config.json", (good / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (good / "adapter_model.safetensors").read_bytes())}
    ok = client.post("/console/adapters/upload", data={"tenant_id": acme.id, "name": "via-console"}, files=files,
                     headers={"X-CSRF-Token": token})
    assert ok.status_code == 201 and ok.json()["ok"], ok.text
    page = client.get(f"/console/adapters/{ok.json()['adapter']['id']}").text
    assert "What version 1 changes" in page and "DoRA <strong>no</strong>" in page, page
    assert f"<tr><td>q_proj</td><td class=\"num\">{cfg.num_layers}</td>" in page, page
    pickle = {"adapter_config": ("adapter_config.json", (good / "adapter_config.json").read_bytes()),
              "adapter_model": ("adapter_model.safetensors", b"\x80\x04\x95 pickle bytes, not safetensors")}
    before = server.services.registry.list_all(acme.id)
    refused = client.post("/console/adapters/upload", data={"tenant_id": acme.id, "name": "evil"}, files=pickle,
                          headers={"X-CSRF-Token": token})
    assert refused.status_code == 400 and not refused.json()["ok"] and refused.json()["message"]
    assert server.services.registry.list_all(acme.id) == before
