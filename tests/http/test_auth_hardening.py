"""Authentication hardening against the real ASGI app: forwarded addresses are
believed from trusted proxies only; a flood of unknown keys never evicts real keys' cached answers (the
per-address cut-off of a random-key flood is in tests/http/test_hostile_requests.py); /metrics can be closed
with a key and shows adapter ids, never names; non-ASCII credentials and CSRF tokens are refusals, not
500s; sign-out revokes the session server-side; console cookies are Secure behind a trusted TLS proxy."""
from __future__ import annotations

import re
import secrets
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_stack, new_tenant_key
from loramux.admin.deps import AdminDep
from loramux.model.loader import read_model_config
from loramux.server.deps import TenantDep
from loramux.tenancy.admin_keys import AdminKeyInfo
from loramux.tenancy.tenants import TenantContext, TierInfo
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-test-auth-hardening-key-0123456789abcdefgh"
METRICS_KEY = "scrape-secret-0123456789"
PROXY = "10.9.8.7"  # the trusted reverse proxy in front of the app
FAILURES_PER_MIN = 5


@contextmanager
def proxied_client(tiny_dir, tokenizer, tmp):
    """A client of the app behind the trusted proxy PROXY: metrics key, FAILURES_PER_MIN failed keys a minute."""
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_loras=2, max_lora_rank=8),
                    client=dict(client=(PROXY, 4321), follow_redirects=False), admin_key=ADMIN_KEY,
                    metrics_key=METRICS_KEY, trusted_proxies=PROXY, auth_failures_per_min=FAILURES_PER_MIN,
                    max_upload_bytes=256 * 1024) as c:
        yield c


@pytest.fixture(scope="module")
def client(tiny_dir, tokenizer, tmp_path_factory):
    with proxied_client(tiny_dir, tokenizer, tmp_path_factory.mktemp("auth-hardening")) as c:
        yield c


@contextmanager
def peer(client, address: str):
    """Requests from `client` come from the TCP peer `address` meanwhile (one app, one lifespan)."""
    transport = client._transport
    before, transport.client = transport.client, (address, 1234)
    try:
        yield client
    finally:
        transport.client = before


def via(address: str) -> dict[str, str]:
    """Headers of a request the trusted proxy forwards for `address` (a client's own claim comes first)."""
    return {"X-Forwarded-For": f"6.6.6.6, {address}"}


def random_key() -> str:
    return "lmx-" + secrets.token_urlsafe(32)


def chat(client, key: str, address: str, model: str = "base"):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **via(address)},
                       json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})


# -- failed authentications per client address -------------------------------------------------------------
def test_forwarded_for_is_believed_only_from_a_trusted_proxy(client):
    with peer(client, "192.0.2.77") as direct:  # not a proxy: its header is a lie
        for i in range(FAILURES_PER_MIN):
            assert chat(direct, random_key(), f"192.0.2.{i}").status_code == 401
        assert chat(direct, random_key(), "192.0.2.200").status_code == 429  # counted on its own address


def test_a_flood_of_unknown_keys_never_evicts_a_real_keys_cached_answer(client):
    """The key cache clears its negative side when it fills, never the positive one: a revoked-in-the-database
    key still answered from the cache proves the real key's entry survived the flood."""
    services = client.app.state.services
    good = new_tenant_key(services, "cached-co")
    assert chat(client, good, "198.51.100.20").status_code == 200  # now cached
    cache = services.tenancy._keys
    cache.max_entries = cache.max_negative = 50  # a small cache: the flood below fills it many times over
    for i in range(200):  # from many addresses, so the per-address limit does not stop the flood
        assert chat(client, random_key(), f"100.64.{i // 250}.{i % 250}").status_code == 401
    lookups = []
    real_lookup = services.tenancy._lookup
    services.tenancy._lookup = lambda digest: lookups.append(digest) or real_lookup(digest)
    try:
        assert chat(client, good, "198.51.100.20").status_code == 200
    finally:
        services.tenancy._lookup = real_lookup
    assert lookups == []  # served from the cache: the flood did not clear it


def test_non_ascii_credentials_are_refusals_not_errors(client):
    for key in ("lmx-clé-ünïcödé", "lmxa-ключ", "lmx-" + "☃" * 40):
        response = client.get("/v1/models", headers={"Authorization": f"Bearer {key}".encode(), **via("192.0.2.9")})
        assert response.status_code in (401, 403, 429), response.text
    response = client.get("/metrics", headers={"Authorization": "Bearer schlüssel".encode()})
    assert response.status_code == 401


# -- /metrics --------------------------------------------------------------------------------------------------
def test_metrics_need_the_metrics_key_when_one_is_set(client):
    assert client.get("/metrics").status_code == 401
    wrong = client.get("/metrics", headers={"Authorization": "Bearer not-it"})
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    assert client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 401
    ok = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert ok.status_code == 200 and "vllm:lora_requests_info" in ok.text
    assert client.get("/health").status_code == 200  # the other open paths stay open


def test_the_engine_knows_registry_adapters_by_id_never_by_name(client, tiny_dir, tmp_path):
    """What the engine is given is what its stats, and so `vllm:lora_requests_info`, list."""
    services = client.app.state.services
    new_tenant_key(services, "acme")
    cfg = read_model_config(tiny_dir)[0]
    directory = write_peft_adapter(tmp_path / "secret-project", cfg, 4, ["q_proj", "v_proj"], seed=3)
    files = {f: (f, (directory / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
    uploaded = client.post("/admin/adapters", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                           data={"tenant_id": "acme", "name": "secret-project-x"},
                           files={"adapter_config": files["adapter_config.json"],
                                  "adapter_model": files["adapter_model.safetensors"]})
    assert uploaded.status_code == 201, uploaded.text
    version = services.registry.resolve(uploaded.json()["tenant_id"], "secret-project-x")
    lease = client.portal.call(services.adapter_cache.acquire, version)
    try:
        assert lease.adapter.name == f"{version.adapter_id}@{version.version}"
    finally:
        services.adapter_cache.release(version.digest)
    residency = getattr(services.engine, "engine", services.engine).adapters
    residency.add_waiting(lease.adapter)  # as a queued request for it would
    try:
        body = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    finally:
        residency.drop_waiting(lease.adapter.digest)
    assert "secret-project" not in body
    (info,) = [s for f in text_string_to_metric_families(body) if f.name == "vllm:lora_requests_info"
               for s in f.samples]
    assert info.labels["waiting_lora_adapters"] == f"{version.adapter_id}@{version.version}"


# -- the console -----------------------------------------------------------------------------------------------
def login_form(client, headers: dict[str, str] | None = None) -> str:
    page = client.get("/console/login", headers=headers or {})
    return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)


def test_a_non_ascii_login_csrf_token_is_a_403_not_a_500(client):
    login_form(client)
    response = client.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": "jeton-é-ü-☃"})
    assert response.status_code == 403
    token = login_form(client)
    response = client.post("/console/login", data={"admin_key": "lmxa-ключ-" + "é" * 30, "csrf_token": token})
    assert response.status_code == 401


def sign_in(client, address: str, headers: dict[str, str] | None = None):
    """Sign in from `address` with a fresh cookie jar; the response (its cookie stays in the jar)."""
    client.cookies.clear()
    with peer(client, address):
        token = login_form(client, headers)
        return client.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": token},
                           headers=headers or {})


def test_sign_out_revokes_the_session_server_side(client):
    assert sign_in(client, "192.0.2.50").status_code == 303
    cookie = client.cookies.get("loramux_console")
    page = client.get("/console/tenants")
    assert page.status_code == 200
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text).group(1)
    assert client.post("/console/logout", data={"csrf_token": csrf}).status_code == 303
    client.cookies.clear()
    client.cookies.set("loramux_console", cookie, path="/console")  # a copy of the cookie kept from before
    assert client.get("/console/tenants").status_code in (303, 307)  # sent to sign in: the session is over
    assert sign_in(client, "192.0.2.50").status_code == 303
    assert client.get("/console/tenants").status_code == 200  # a new session works


def test_cookies_are_secure_behind_a_trusted_tls_proxy_only(client):
    behind_tls = sign_in(client, PROXY, {"X-Forwarded-Proto": "https"})
    assert "secure" in behind_tls.headers["set-cookie"].lower()
    spoofed = sign_in(client, "192.0.2.60", {"X-Forwarded-Proto": "https"})  # not a proxy: ignored
    assert spoofed.status_code == 303 and "secure" not in spoofed.headers["set-cookie"].lower()
    plain = sign_in(client, PROXY)
    assert plain.status_code == 303 and "secure" not in plain.headers["set-cookie"].lower()


def test_console_secure_cookies_always(client):
    settings = client.app.state.services.settings
    settings.console_secure_cookies = "always"
    try:
        response = client.get("/console/login")  # over plain HTTP, as a proxy not listed would forward it
    finally:
        settings.console_secure_cookies = "auto"
    assert "secure" in response.headers["set-cookie"].lower()


def test_without_the_ingress_the_route_dependencies_refuse_the_same_keys():
    """An app assembled without `Ingress`: get_tenant and get_admin run the same checks themselves."""
    tier = TierInfo("free", 0, 0, 0, 0, 60.0, 60.0)
    tenants = {"lmx-good": TenantContext("t1", "acme", "active", "k1", "lmx-goo", tier, "none"),
               "lmx-paused": TenantContext("t2", "idle-co", "suspended", "k2", "lmx-pau", tier, "none")}
    admins = {"lmxa-good": AdminKeyInfo("a1", "ops", "lmxa-go", datetime.now(timezone.utc), None)}
    app = FastAPI()
    app.state.services = SimpleNamespace(tenancy=SimpleNamespace(authenticate=tenants.get),
                                         admin_keys=SimpleNamespace(authenticate=admins.get))

    @app.get("/tenant")
    def tenant_route(tenant: TenantDep) -> dict:
        return {"tenant": tenant.tenant_name}

    @app.get("/admin")
    def admin_route(admin: AdminDep) -> dict:
        return {"admin": admin.name}

    def call(path: str, key: str | None):
        response = client.get(path, headers={"Authorization": f"Bearer {key}"} if key else {})
        return response.status_code, response.json(), response.headers.get("www-authenticate")

    with TestClient(app) as client:
        assert call("/tenant", "lmx-good") == (200, {"tenant": "acme"}, None)
        assert call("/admin", "lmxa-good") == (200, {"admin": "ops"}, None)
        assert call("/tenant", None) == (401, {"detail": "missing API key: send `Authorization: Bearer <your key>`"},
                                         "Bearer")
        assert call("/tenant", "lmx-unknown") == (401, {"detail": "invalid or revoked API key"}, "Bearer")
        assert call("/tenant", "lmxa-good")[:2] == (403, {"detail": "admin keys are not accepted on tenant routes: "
                                                                    "use a tenant API key"})
        assert call("/tenant", "lmx-paused")[:2] == (403, {"detail": "tenant 'idle-co' is suspended; contact your "
                                                                     "administrator"})
        assert call("/admin", None)[:2] == (401, {"detail": "missing admin key: send `Authorization: Bearer "
                                                            "<admin key>`"})
        assert call("/admin", "lmxa-unknown") == (401, {"detail": "invalid or revoked admin key"}, "Bearer")
        assert call("/admin", "lmx-good")[:2] == (403, {"detail": "tenant API keys are not accepted on admin "
                                                                  "routes: use an admin key"})
        schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
    assert set(schemes) == {"HTTPBearer", "AdminKey"}
