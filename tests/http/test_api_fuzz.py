"""Schemathesis against the live server's own OpenAPI schema: every operation, generated valid and
invalid inputs, over real HTTP (uvicorn on 127.0.0.1). No input may get a 5xx, and no stream may end in
an error event (a failure after the headers went out never shows as a status code). Every operation is
fuzzed with a tenant key (the admin routes only up to their refusal, 403), and the admin routes again
with a valid admin key, their path ids often steered to real tenants, keys and adapters."""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance

from conftest import adapter_files, live_stack, new_tenant_key
from loramux.model.loader import read_model_config
from loramux.server.app import create_app
from loramux.testing import write_peft_adapter

MAX_TOKENS = 6  # generation cost is what makes this test slow: keep every request short
EXAMPLES = 25  # per operation and generation mode
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fuzz_stack(tiny_dir, tokenizer, tmp_path_factory):
    """One server for the module; a premium tenant (no rate limits) owning one adapter."""
    tmp = tmp_path_factory.mktemp("api-fuzz")
    cfg, _ = read_model_config(tiny_dir)
    # Fuzzed headers carry bad keys: with the per-address failed-authentication limit on, the rest of the
    # fuzz would meet only 429s. It is off here (tests/http/test_auth_hardening.py covers it).
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_loras=2, max_lora_rank=8),
                    auth_failures_per_min=0) as server:
        key = new_tenant_key(server.services, "fuzz-co", "premium")
        tenant = server.services.tenancy.tenant("fuzz-co")
        path = write_peft_adapter(tmp / "alpha", cfg, 4, ["q_proj", "v_proj"], seed=0)
        files = adapter_files(path)
        server.services.registry.register(tenant.id, "alpha", files)
        # The admin fuzz acts on its own tenant (its keys may be revoked, its adapter deleted).
        target = server.services.tenancy.create_tenant("admin-fuzz-co", tier="standard")
        server.services.tenancy.create_key(target.id)
        server.services.registry.register(target.id, "beta", files)
        server.admin_key = server.services.admin_keys.create("fuzz")[1]
        yield server, key


@pytest.fixture(scope="module")
def api_schema(fuzz_stack):
    """The schema as the running server serves it."""
    server, _ = fuzz_stack
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# The operations, listed at collection time from the app's own schema (no server needed for that); the
# test itself loads the schema the live server serves. (schemathesis' lazy `pytest.from_fixture` does not
# work under pytest 9: it writes `node._nodeid`, which pytest 9 no longer has.)
OPERATIONS = [(method.upper(), path) for path, methods in create_app(lambda: None).openapi()["paths"].items()
              for method in methods]


ADMIN_OPERATIONS = [(m, p) for m, p in OPERATIONS if p.startswith("/admin")]


# Models the generated `model` / `adapter_id` strings are swapped for (chosen by the string's length, so a
# case replays identically): the base model under both names, the tenant's adapter, and an unknown one.
TARGETS = ("base", MODEL, "alpha", None)
GENERATING = ("/v1/chat/completions", "/v1/completions", "/generate")


def shorten(path, body):
    """Cap the generation length of a generated body, and steer it towards the engine: a model that
    exists (else 404), a /generate body with exactly one of `prompt`, `messages` (else 422), often a
    single prompt rather than a batch (400), streaming for about half of them. Choices depend on the
    body only, so a case replays identically. Non-dict bodies (negative cases) pass unchanged."""
    if not isinstance(body, dict) or path not in GENERATING:
        return body
    body = dict(body)
    if isinstance(body.get("stream", False), bool):
        body["stream"] = len(body) % 2 == 1
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(field)
        # JSON Schema integers include 7.0, and pydantic takes it: cap floats too. (min_tokens too, else
        # /generate refuses min_tokens > max_tokens: the OpenAI routes clip it.)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
        elif field == "max_tokens" and field not in body:
            body[field] = MAX_TOKENS  # the defaults are 16 (completions), 256 (/generate), the context (chat)
    if path == "/generate":  # exactly one of prompt, messages: a rule the schema does not express
        given = [f for f in ("prompt", "messages") if body.get(f) is not None]
        if len(given) == 2:
            del body[given[len(body) % 2]]
        elif not given:
            body["prompt"] = "Once upon a time"
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and len(prompt) > 1 and len(body) % 2:
        if isinstance(prompt[0], (str, list)):
            body["prompt"] = prompt[:1]  # one prompt of a batch (batches are refused, 400)
    for field in ("model", "adapter_id"):
        value = body.get(field)
        if isinstance(value, str):
            target = TARGETS[len(value) % len(TARGETS)]
            if target is not None:
                body[field] = target
    return body


def no_error_event(ctx, response, case):
    """A streamed (SSE) response must not carry an error event."""
    if "text/event-stream" not in response.headers.get("content-type", [""])[0]:
        return None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise AssertionError(f"the stream ended in an error event: {event}")
    return None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_input_gets_a_server_error(api_schema, fuzz_stack, method, path, mode):
    _, key = fuzz_stack

    def prepare(case):
        case.body = shorten(path, case.body)

    fuzz(api_schema[path][method], mode, key, prepare, [not_a_server_error, content_type_conformance, no_error_event])


def fuzz(operation, mode, key: str, prepare, checks, inputs=("body", "query", "headers")) -> None:
    """Call `operation` with generated cases (each passed through `prepare` first) and the bearer `key`;
    every check must pass. Skips negative mode when the operation takes none of `inputs`."""
    if mode is GenerationMode.NEGATIVE and not any(getattr(operation, name) for name in inputs):
        pytest.skip("nothing to send wrong")

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    def run(case):
        prepare(case)
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, timeout=60, checks=checks)

    run()


def steer_admin_ids(services, case) -> None:
    """Swap generated path ids for real ones about two times in three (chosen by the generated string, so
    a case replays identically): random ids only ever reach the 404 path."""
    params = case.path_parameters or {}
    tenant = services.tenancy.tenant("admin-fuzz-co")
    real = {"tenant_id": [tenant.id, "admin-fuzz-co"],
            "key_id": [k.id for k in services.tenancy.list_keys(tenant.id)][-1:],
            "adapter_id": [v.adapter_id for v in services.registry.list_all(tenant.id)][:1]}
    for name, value in params.items():
        choices = real.get(name) or []
        if isinstance(value, str) and choices and len(value) % 3:
            params[name] = choices[len(value) % len(choices)]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), ADMIN_OPERATIONS, ids=[f"{m} {p}" for m, p in ADMIN_OPERATIONS])
def test_no_admin_input_gets_a_server_error(api_schema, fuzz_stack, method, path, mode):
    server, _ = fuzz_stack
    fuzz(api_schema[path][method], mode, server.admin_key, lambda case: steer_admin_ids(server.services, case),
         [not_a_server_error, content_type_conformance], inputs=("body", "query", "headers", "path_parameters"))


# Schemathesis generates valid Unicode only, but JSON can carry a lone surrogate (`"\ud800"`): the
# tokenizer (/v1/completions) and the registry's SQL lookup (/generate's adapter_id) answered 500 to it.
LONE = '"x\\ud800y"'  # JSON text of a string with a lone high surrogate
SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "base", "prompt": ' + LONE + ', "max_tokens": 2}'),
    ("/v1/completions", '{"model": "base", "prompt": [' + LONE + '], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "base", "prompt": "hi", "stop": ' + LONE + ', "max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": ' + LONE + '}], '
                             '"max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": ' + LONE + '}]}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": ' + LONE + ', "messages": [{"role": "user", "content": "hi"}], '
                             '"max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": "hi"}], "user": ' + LONE
                             + ', "response_format": {"type": "text", "x": [' + LONE + ']}, "max_tokens": 2}'),
    ("/generate", '{"prompt": ' + LONE + ', "max_tokens": 2}'),
    ("/generate", '{"prompt": "hi", "adapter_id": ' + LONE + ', "max_tokens": 2}'),
    ("/generate", '{"messages": [{"role": "user", "content": ' + LONE + '}], "max_tokens": 2, "stream": true}'),
]


@pytest.mark.parametrize(("path", "raw"), SURROGATE_BODIES,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(SURROGATE_BODIES)])
def test_lone_surrogates_are_refused_with_422(fuzz_stack, path, raw):
    server, key = fuzz_stack
    resp = httpx.post(f"{server.url}{path}", content=raw.encode(), timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    # 400 where every invalid field is one OpenAI answers with 400 (user, response_format), else 422.
    assert resp.status_code == (400 if '"user": ' + LONE in raw else 422), resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_parameter" and "unicode" in error["message"].lower(), error
