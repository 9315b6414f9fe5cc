"""Fan-out (`models`): one prompt to N adapters in one call, over real HTTP with the official `openai` client.

Each choice equals the single request to its adapter (greedy and seeded) and what HF transformers + PEFT
generate greedily for it; the N sequences run in the same engine batches; the ledger has one row per adapter
(same request id, parts 0..N-1) adding up to the usage returned, on SQLite and PostgreSQL; refusals (limits,
bad lists, unknown adapters, unloadable ones) hold nothing and bill nothing; a cancelled stream bills every
part."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from sqlalchemy import select

from conftest import adapter_files, admin_client, live_stack, new_tenant_key, peft_greedy_texts
from loramux.db import LedgerEntry
from loramux.model.loader import read_model_config
from loramux.testing import write_peft_adapter
from polling import wait_until

ADMIN_KEY = "lmxa-fanout-admin-key-0123456789abcdefghijklmnop"
ADAPTERS = [f"ad{i}" for i in range(8)]
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = [1, 450, 3200, 17, 99, 23001, 871]  # token ids: exactly what PEFT gets
NEW_TOKENS = 8
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


def write_adapters(root, cfg) -> dict:
    return {name: write_peft_adapter(root / name, cfg, 4 + 2 * (i % 3), TARGETS, seed=100 + i, b_std=1.0)
            for i, name in enumerate(ADAPTERS)}


def register_all(services, tenant: str, dirs: dict) -> dict:
    tenant_id = services.tenancy.tenant(tenant).id
    return {name: services.registry.register(tenant_id, name, adapter_files(path)) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def peft_reference(tiny_dir, tmp_path_factory, tokenizer):
    """({adapter: its directory}, {adapter or None: the text PEFT generates greedily for PROMPT})."""
    cfg, _ = read_model_config(tiny_dir)
    dirs = write_adapters(tmp_path_factory.mktemp("fanout-adapters"), cfg)
    expected = peft_greedy_texts(tiny_dir, tokenizer, dirs, PROMPT, NEW_TOKENS)
    return dirs, expected


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory, peft_reference):
    """One server: tenants on each tier, the 8 adapters registered for the standard tenant `acme`, and a
    ledger hook that records every finished request."""
    tmp = tmp_path_factory.mktemp("fanout")
    records: list = []
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_lora_rank=8, max_num_seqs=32), admin_key=ADMIN_KEY,
                    auth_failures_per_min=0, ledger_hooks=[records.append]) as server:
        services = server.services
        keys = {tier: new_tenant_key(services, f"{tier}-co", tier) for tier in ("free", "premium")}
        keys["acme"] = new_tenant_key(services, "acme", "standard")
        versions = register_all(services, "acme", peft_reference[0])
        for tier in ("free", "premium"):  # the same adapters, their own copies
            register_all(services, f"{tier}-co", {n: peft_reference[0][n] for n in ADAPTERS})
        yield server, keys, records, versions


def client(stack, who: str = "acme") -> openai.OpenAI:
    server, keys = stack[0], stack[1]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys[who], max_retries=0, timeout=120)


def post(stack, route: str, body: dict, who: str = "acme") -> httpx.Response:
    server, keys = stack[0], stack[1]
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {keys[who]}"})


def leases_held(server) -> int:
    """Host-RAM leases the adapter cache holds (each request's lease on its adapters)."""
    host = server.services.adapter_cache.host
    return sum(entry.leases for entry in host._entries.values())


def engine_is_idle(server) -> bool:
    stats = server.services.engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


def sse_chunks(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def test_fanout_to_8_adapters_equals_8_single_requests_and_peft(stack, peft_reference):
    server, _, records, versions = stack
    expected = peft_reference[1]
    assert len({expected[n] for n in ADAPTERS} | {expected[None]}) >= 6  # the adapters really change the output
    body = {"model": "base", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    singles = {}
    for name in ADAPTERS:
        resp = post(stack, "completions", {**body, "model": name})
        assert resp.status_code == 200, resp.text
        singles[name] = resp.json()["choices"][0]["text"]
        assert singles[name] == expected[name], name

    # The 8 sequences of one call run in the same engine batches: some step gives all of them a token.
    llm, steps = server.services.engine.engine, []
    real_step = llm.step

    def spying_step():
        outputs = real_step()
        steps.append({o.request_id for o in outputs})
        return outputs

    llm.step = spying_step
    before = len(records)
    try:
        resp = post(stack, "completions", {**body, "models": ADAPTERS})
    finally:
        llm.step = real_step
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    rid = answer["id"]
    parts = {rid, *(f"{rid}.{i}" for i in range(1, 8))}
    assert any(parts <= step for step in steps)
    assert [c["index"] for c in answer["choices"]] == list(range(8))
    assert [c["model"] for c in answer["choices"]] == ADAPTERS
    assert {c["model"]: c["text"] for c in answer["choices"]} == singles
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    fanout = answer["loramux"]["fanout"]
    assert [p["adapter"]["id"] for p in fanout] == [versions[n].adapter_id for n in ADAPTERS]
    assert [p["model"] for p in fanout] == ADAPTERS and not any("fallback" in p for p in fanout)

    # One record per adapter, one request id, parts 0..7, adding up to the usage returned.
    rows = records[before:]
    assert sorted(r.part for r in rows) == list(range(8)) and {r.request_id for r in rows} == {rid}
    by_part = sorted(rows, key=lambda r: r.part)
    assert [r.adapter_id for r in by_part] == [versions[n].adapter_id for n in ADAPTERS]
    assert [r.requested for r in by_part] == ADAPTERS
    assert all(r.outcome == "length" and r.completion_tokens == NEW_TOKENS for r in rows)
    assert all(r.prompt_tokens == len(PROMPT) for r in rows)  # each adapter computed the prompt
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in rows) == 8 * len(PROMPT)
    assert usage["completion_tokens"] == sum(r.completion_tokens for r in rows) == 8 * NEW_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(r.cached_tokens for r in rows)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # Streamed: every chunk names its choice's index and model; the texts are the same.
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={**body, "models": ADAPTERS, "stream": True, "stream_options": {"include_usage": True}},
                      headers={"Authorization": f"Bearer {stack[1]['acme']}"}) as streamed:
        chunks = sse_chunks(streamed)
    texts: dict[str, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice["model"] == ADAPTERS[choice["index"]]
            texts[choice["model"]] = texts.get(choice["model"], "") + choice["text"]
    assert texts == singles
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 10, detail=server.services.engine.stats)
    assert leases_held(server) == 0


def test_chat_fanout_streamed_and_not_with_the_openai_client(stack):
    c = client(stack)
    models = ["base", "ad1", "ad2"]
    kwargs = dict(messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [c.chat.completions.create(model=m, **kwargs) for m in models]
    singles = [one.choices[0].message.content for one in alone]
    full = c.chat.completions.create(model=MODEL, **{**kwargs, "extra_body": {"ignore_eos": True, "models": models}})
    assert [ch.model_extra["model"] for ch in full.choices] == models
    assert [ch.message.content for ch in full.choices] == singles
    assert full.model == MODEL and full.model_extra["loramux"]["fanout"][0]["adapter"] is None

    stream = c.chat.completions.create(model="base", stream=True, stream_options={"include_usage": True},
                                       **{**kwargs, "extra_body": {"ignore_eos": True, "models": models}})
    texts = [""] * 3
    finishes = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.model_extra["model"] == models[choice.index]
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == singles and finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)


def test_a_seed_gives_each_adapter_its_single_request_sample(stack):
    """Sampled with a seed, part i samples with that seed (not seed + i as `n`'s siblings do): each choice is
    the single seeded request to its adapter."""
    c = client(stack)
    kwargs = dict(prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True, "top_k": 50})
    singles = [c.completions.create(model=m, **kwargs).choices[0].text for m in ("ad3", "ad4")]
    fanned = c.completions.create(model="ad3", **{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                                           "models": ["ad3", "ad4"]}})
    assert [ch.text for ch in fanned.choices] == singles


@pytest.mark.parametrize(("who", "models", "n", "model", "message"), [
    ("free", ["ad0", "ad1", "ad2"], 1, "base", "tier 'free' allows at most 2 per request (max_fanout)"),
    ("acme", ADAPTERS + ["base"], 1, "base", "tier 'standard' allows at most 8 per request (max_fanout)"),
    ("premium", [f"x{i}" for i in range(17)], 1, "base", "at most 16 (LORAMUX_MAX_FANOUT)"),
    ("acme", [], 1, "base", "models must name at least one adapter"),
    ("acme", "ad0", 1, "base", "models: Input should be a valid list"),
    ("acme", ["ad0", 7], 1, "base", "models.1: Input should be a valid string"),
    ("acme", ["ad0", ""], 1, "base", "models[1] must be an adapter reference of 1 to 300 characters"),
    ("acme", ["ad0", "ad1", "ad0"], 1, "base", "models[2] ('ad0') names the same model as models[0]"),
    ("acme", ["base", MODEL], 1, "base", f"models[1] ('{MODEL}') names the same model as models[0] ('base')"),
    ("acme", ["ad0", "ad1"], 1, "ad1", "model must be the base model ('base') or models[0] ('ad0'); got 'ad1'"),
    ("acme", ["ad0", "ad1"], 2, "ad0", "n=2 cannot be combined with models"),
    ("acme", ["ad0", "ad\x00"], 1, "ad0", "models[1] must not contain control characters"),
])
def test_bad_fanouts_are_400_and_say_what_to_fix(stack, who, models, n, model, message):
    server, _, records, _ = stack
    before = len(records)
    resp = post(stack, "completions", {"model": model, "prompt": "hi", "max_tokens": 2, "n": n, "models": models},
                who=who)
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]["message"], resp.json()
    assert resp.json()["error"]["param"].split(".")[0] in ("models", "model", "n")
    assert len(records) == before and leases_held(server) == 0


def test_a_fanout_cannot_also_combine_adapters(stack):
    """`models` (each adapter on its own) and `adapters` (one weighted composition) are two different asks."""
    server, _, records, _ = stack
    before = len(records)
    resp = post(stack, "completions", {"model": "base", "prompt": "hi", "max_tokens": 2, "models": ["ad0", "ad1"],
                                       "adapters": [{"model": "ad0", "weight": 0.5}, {"model": "ad1", "weight": 0.5}]})
    assert resp.status_code == 400, resp.text
    assert "either `adapters`" in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "models"
    assert len(records) == before and leases_held(server) == 0


def test_an_adapter_the_tenant_cannot_see_is_a_404_naming_it_with_nothing_held(stack, tiny_dir, tmp_path):
    server, keys, records, versions = stack
    services = server.services
    cfg, _ = read_model_config(tiny_dir)
    private = write_peft_adapter(tmp_path / "secret", cfg, 4, ["q_proj"], seed=5)
    services.registry.register(services.tenancy.tenant("premium-co").id, "secret", adapter_files(private),
                               visibility="private")
    tenant = services.tenancy.authenticate(keys["acme"])
    before = len(records)
    for models, named in ((["ad0", "ad1", "ad2", "nope"], "models[3] 'nope' not found"),
                          (["ad0", "premium-co/secret"], "models[1] 'premium-co/secret' not found")):
        resp = post(stack, "chat/completions", {"model": "base", "messages": CHAT, "max_tokens": 2, "models": models})
        assert resp.status_code == 404, resp.text
        assert named in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "models"
    # Two references of one adapter version (its name and its id) are a 400 once resolved.
    resp = post(stack, "completions", {"model": "base", "prompt": "hi", "max_tokens": 2,
                                       "models": ["ad0", versions["ad0"].adapter_id]})
    assert resp.status_code == 400 and "are the same adapter version" in resp.json()["error"]["message"]
    assert len(records) == before  # no ledger rows for a refused call
    assert leases_held(server) == 0 and server.app.state.pipeline.limiter.in_flight(tenant.tenant_id) == 0
    assert engine_is_idle(server)


def test_an_adapter_that_cannot_load_gives_back_the_others_or_falls_back(stack, tiny_dir, tmp_path):
    """One unloadable adapter among several: a 503 with every other lease given back; with the tenant's
    fallback to the base model, that part is served by the base model and its row says so."""
    server, keys, records, _ = stack
    services = server.services
    cfg, _ = read_model_config(tiny_dir)
    path = write_peft_adapter(tmp_path / "broken", cfg, 4, ["q_proj"], seed=9)
    tenant = services.tenancy.tenant("acme")
    version = services.registry.register(tenant.id, "broken", adapter_files(path))
    services.store.delete(version.storage_key)
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "models": ["ad5", "broken", "ad6"]}
    before = len(records)
    resp = post(stack, "completions", body)
    assert resp.status_code == 503 and "broken@1 could not be loaded" in resp.json()["error"]["message"]
    assert len(records) == before and leases_held(server) == 0
    services.tenancy.set_tenant(tenant.id, fallback="base")
    try:
        resp = post(stack, "completions", body)
    finally:
        services.tenancy.set_tenant(tenant.id, fallback="none")
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    base = post(stack, "completions", {**body, "model": "base", "models": None}).json()["choices"][0]["text"]
    assert answer["choices"][1]["model"] == "broken" and answer["choices"][1]["text"] == base
    assert answer["loramux"]["fanout"][1]["fallback"]["requested"] == "broken"
    assert answer["loramux"]["fanout"][1]["adapter"] is None
    rows = sorted((r for r in records if r.request_id == answer["id"]), key=lambda r: r.part)
    assert [(r.part, r.fallback, r.adapter_id is None) for r in rows] == [(0, False, False), (1, True, True),
                                                                          (2, False, False)]
    assert leases_held(server) == 0


def test_cancelling_a_streamed_fanout_bills_every_part(stack):
    server, keys, records, _ = stack
    models = ["ad0", "ad3", "ad7", "base"]
    body = {"model": "base", "prompt": "Count:", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "models": models}
    # Hold the engine once every part has produced output, so none can finish (a fast machine makes 400 tiny-model
    # tokens in about a second) before the client leaves.
    llm, resume, produced = server.services.engine.engine, threading.Event(), set()
    real_step = llm.step

    def step_until_every_part_has_output():
        if len(produced) >= len(models):
            resume.wait(30)
        outputs = real_step()
        produced.update(o.request_id for o in outputs)
        return outputs

    llm.step = step_until_every_part_has_output
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {keys['acme']}"}) as resp:
            request_id = resp.headers["x-request-id"]
            seen: set[int] = set()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
                if len(seen) == len(models):
                    assert leases_held(server) == 3  # the three adapters, while it runs
                    break  # every part has streamed: leave mid-stream (the line iterator closes the connection)
        wait_until(lambda: sorted(r.part for r in records if r.request_id == request_id) == [0, 1, 2, 3],
                   "a ledger record for every part", 30)
    finally:
        resume.set()
        llm.step = real_step
    rows = [r for r in records if r.request_id == request_id]
    assert {r.outcome for r in rows} == {"cancelled"} and all(0 < r.completion_tokens < 400 for r in rows)
    assert [r.requested for r in sorted(rows, key=lambda r: r.part)] == models
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 10, detail=server.services.engine.stats)
    assert leases_held(server) == 0


def test_one_admission_covers_every_part_and_each_part_is_a_request(stack, peft_reference):
    """A fan-out is one admission, holding one concurrency slot per adapter, charged prompt + max_tokens per
    adapter and one request per adapter of the tier's requests per minute (a tier with max_fanout 2 would
    otherwise get twice its rate): a budget a single request fits can refuse the same call fanned out, with
    429 and Retry-After while the parts do not fit yet, and 400 when they never can."""
    from loramux.tenancy.tenants import TierInfo

    server, _, _, _ = stack
    services = server.services
    services.tenancy.upsert_tier(TierInfo("fan-trial", 0, requests_per_min=3, tokens_per_min=150, max_concurrent=0,
                                          default_timeout_s=30, max_timeout_s=60, max_fanout=4))
    key = new_tenant_key(services, "fan-co", "fan-trial")
    register_all(services, "fan-co", {n: peft_reference[0][n] for n in ("ad0", "ad1", "ad2", "ad3")})
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "base", "prompt": "hi", "max_tokens": 60, "ignore_eos": True}

    def post(**extra) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, headers=headers, timeout=60)

    resp = post(models=["ad0", "ad1", "ad2"])
    assert resp.status_code == 400 and "exceed your tier's limit of 150 tokens per minute" in resp.text
    resp = post(max_tokens=5, models=["ad0", "ad1", "ad2", "ad3"])
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "request_too_large", resp.text
    assert "fans out to 4 adapters, 4 requests' worth, above your tier's limit of 3 requests per minute" in resp.text
    resp = post(max_tokens=10, models=["ad0", "ad1"])  # two of the 3 per minute
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 20  # two sequences of 10
    resp = post(max_tokens=10, models=["ad0", "ad1"])  # one left: the two parts do not fit
    assert resp.status_code == 429 and "3 requests per minute" in resp.text, resp.text
    assert int(resp.headers["Retry-After"]) >= 1
    resp = post(max_tokens=10)  # the refusal took nothing: one plain request still passes
    assert resp.status_code == 200, resp.text
    resp = post(max_tokens=10)
    assert resp.status_code == 429 and "3 requests per minute" in resp.text


def test_max_fanout_is_a_tier_setting_of_the_admin_api(stack):
    server, _, _, _ = stack
    with admin_client(server, ADMIN_KEY) as admin:
        tiers = {t["name"]: t for t in admin.get("/admin/tiers").json()["tiers"]}
        assert {n: tiers[n]["max_fanout"] for n in ("free", "standard", "premium")} == \
            {"free": 2, "standard": 8, "premium": 16}
        put = admin.put("/admin/tiers/fan-three", json={"priority": 1, "default_timeout_s": 30, "max_timeout_s": 60,
                                                        "max_fanout": 3})
        assert put.status_code == 200 and put.json()["max_fanout"] == 3
        bad = admin.put("/admin/tiers/fan-bad", json={"priority": 1, "default_timeout_s": 30, "max_timeout_s": 60,
                                                      "max_fanout": 0})
        assert bad.status_code == 422 and "max_fanout" in bad.text
    key = new_tenant_key(server.services, "three-co", "fan-three")
    resp = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "base", "prompt": "hi", "max_tokens": 2,
                            "models": ["base", "acme/a", "acme/b", "acme/c"]})
    assert resp.status_code == 400 and "tier 'fan-three' allows at most 3" in resp.json()["error"]["message"]


# -- the ledger itself, on SQLite and PostgreSQL ---------------------------------------------------------

@pytest.fixture
def billed(database_url, tiny_dir, tokenizer, tmp_path, peft_reference):
    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_lora_rank=8), database_url=database_url) as server:
        key = new_tenant_key(server.services, "acme", "standard")
        register_all(server.services, "acme", peft_reference[0])
        yield server, key


def ledger_rows(server, request_id: str) -> list[LedgerEntry]:
    with server.services.db.session() as s:
        return list(s.scalars(select(LedgerEntry).where(LedgerEntry.request_id == request_id)
                              .order_by(LedgerEntry.part)))


@pytest.mark.parametrize("stream", [False, True])
def test_the_ledger_has_a_row_per_adapter_adding_up_to_the_usage(billed, stream):
    server, key = billed
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "models": ADAPTERS, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    headers = {"Authorization": f"Bearer {key}"}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=120) as resp:
            chunks = sse_chunks(resp)
        request_id, usage = chunks[-1]["id"], chunks[-1]["usage"]
    else:
        resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
        assert resp.status_code == 200, resp.text
        request_id, usage = resp.json()["id"], resp.json()["usage"]
    # The answer went out only once every row was durable; flush() waits for the SQL insert.
    assert server.services.ledger.flush(30)
    rows = ledger_rows(server, request_id)
    assert [r.part for r in rows] == list(range(8)) and len({r.adapter_id for r in rows}) == 8
    assert sum(r.prompt_tokens for r in rows) == usage["prompt_tokens"] == 8 * len(PROMPT)
    assert sum(r.completion_tokens for r in rows) == usage["completion_tokens"] == 40
    assert sum(r.cached_tokens for r in rows) == usage["prompt_tokens_details"]["cached_tokens"]
    assert {r.outcome for r in rows} == {"length"}


# -- the fan-out rules and lease handling without a server ------------------------------------------------

class FakeRegistry:
    def resolve(self, tenant_id: str, ref: str):
        from types import SimpleNamespace

        from loramux.adapters.storage.registry import AdapterNotFoundError

        if ref == "nope":
            raise AdapterNotFoundError(ref)
        return SimpleNamespace(adapter_id=f"ad_{ref}", version=1, digest=f"digest-{ref}", label=f"{ref}@1")


class FakeCache:
    """Acquires at once, or for `stuck` versions never (until cancelled), or fails for `broken` ones."""

    def __init__(self, stuck=(), broken=()):
        self.stuck, self.broken = set(stuck), set(broken)
        self.held: list[str] = []
        self.acquired = asyncio.Event()

    async def acquire(self, version, timeout):
        from types import SimpleNamespace

        from loramux.adapters.residency.cache_levels import AdapterLoadError

        if version.adapter_id in self.broken:
            raise AdapterLoadError(version, "gone")
        if version.adapter_id in self.stuck:
            await asyncio.Event().wait()
        self.held.append(version.digest)
        self.acquired.set()
        return SimpleNamespace(adapter=SimpleNamespace(digest=version.digest), level="ram")

    def release(self, digest: str) -> None:
        self.held.remove(digest)


def fake_tenant(fallback: str = "none"):
    from loramux.tenancy.tenants import TenantContext, TierInfo

    tier = TierInfo("standard", 1, 0, 0, 0, 60.0, 120.0, max_fanout=8)
    return TenantContext("tn_x", "x", "active", "key_x", "lmx-x", tier, fallback)


def is_base(ref) -> bool:
    return ref in (None, "", "base", MODEL)


def test_the_server_cap_is_named_when_it_is_below_the_tier():
    from loramux.server.http.errors import ApiError
    from loramux.server.serving.fanout import check_fanout

    tenant = fake_tenant()
    check_fanout(["a", "b", "c", "d"], "base", 1, tenant.tier, 4, is_base)
    with pytest.raises(ApiError, match=r"this server allows at most 4 per request \(max_fanout\)"):
        check_fanout(["a", "b", "c", "d", "e"], "base", 1, tenant.tier, 4, is_base)


@pytest.mark.parametrize("fallback", ["none", "base"])
def test_acquire_parts_gives_back_every_lease_when_one_adapter_fails(fallback):
    from loramux.server.http.errors import ApiError
    from loramux.server.serving.fanout import acquire_parts, release_parts

    cache = FakeCache(broken={"ad_b"})

    async def scenario():
        return await acquire_parts(FakeRegistry(), cache, fake_tenant(fallback), ["a", "b", "base", "c"], 5.0,
                                   MODEL, is_base)

    if fallback == "none":
        with pytest.raises(ApiError, match="b@1"):
            asyncio.run(scenario())
        assert cache.held == []
        return
    parts = asyncio.run(scenario())
    assert [(p.requested, p.version.adapter_id if p.version else None, p.fallback_reason is not None)
            for p in parts] == [("a", "ad_a", False), ("b", None, True), ("base", None, False), ("c", "ad_c", False)]
    assert sorted(cache.held) == ["digest-a", "digest-c"]
    release_parts(cache, parts)
    assert cache.held == []


def test_acquire_parts_cancelled_midway_gives_back_the_leases_taken():
    from loramux.server.serving.fanout import acquire_parts

    cache = FakeCache(stuck={"ad_b"})

    async def scenario():
        task = asyncio.ensure_future(acquire_parts(FakeRegistry(), cache, fake_tenant(), ["a", "b"], 5.0, MODEL,
                                                   is_base))
        await cache.acquired.wait()  # `a` is held, `b` never comes: the client goes away
        assert cache.held == ["digest-a"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert cache.held == []


def test_an_unknown_adapter_is_a_404_before_anything_loads():
    from loramux.server.http.errors import ApiError
    from loramux.server.serving.fanout import acquire_parts

    cache = FakeCache()
    with pytest.raises(ApiError, match=r"models\[1\] 'nope' not found") as info:
        asyncio.run(acquire_parts(FakeRegistry(), cache, fake_tenant(), ["a", "nope"], 5.0, MODEL, is_base))
    assert info.value.status == 404 and info.value.param == "models" and not cache.acquired.is_set()
