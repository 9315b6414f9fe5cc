"""Combining adapters per request (`adapters` with weights) through the server and the official openai client
(`extra_body`): concurrent compositions of 2 and 3 adapters of different ranks and targets, in shared batches
with plain adapters and the base model, each equal to PEFT's `add_weighted_adapter(..., "cat")` greedy tokens;
every refusal (400 / 404 / 503) says what to fix, and no request leaves a host-RAM lease behind; the ledger
row records the composition."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from test_composition import ADAPTERS, COMPOSITIONS, NEW_TOKENS, PROMPTS, _fresh_base, _train_like, build_peft_case

from conftest import adapter_files, live_stack, make_engine, new_tenant_key
from polling import wait_until

MODEL = "SmolLM2-135M-Instruct"  # the base model's id (the tiny test model is served under the default name)
MAX_RANK = 20  # LORAMUX_COMPOSITION_MAX_RANK of the stack: "two" (12) and "three" (18) fit, big + legal (24) not


@pytest.fixture(scope="module")
def peft_case(tmp_path_factory, tokenizer):
    """See `test_composition.build_peft_case`."""
    return build_peft_case(tmp_path_factory.mktemp("composition-case"), tokenizer)


def _no_leases(server) -> bool:
    return all(entry.leases == 0 for entry in server.services.adapter_cache.host._entries.values())


@pytest.fixture(scope="module")
def stack(peft_case, tokenizer, tmp_path_factory):
    """A live server on the PEFT case's model: tenant `acme` owns the case's adapters plus `big` (r=16 on q),
    `dora` (DoRA) and `fragile` (its blob gone from the store); `other` has a private adapter `secret`."""
    from peft import LoraConfig, get_peft_model

    model_dir, dirs, _, _ = peft_case
    tmp = tmp_path_factory.mktemp("composition-http")
    extra = {"big": dict(r=16, lora_alpha=16, target_modules=["q_proj"]),
             "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
             "secret": dict(r=4, lora_alpha=8, target_modules=["q_proj"]),
             "fragile": dict(r=4, lora_alpha=8, target_modules=["o_proj"])}
    for seed, (name, kwargs) in enumerate(extra.items(), start=10):
        peft = get_peft_model(_fresh_base(model_dir), LoraConfig(**kwargs))
        _train_like(peft, seed)
        peft.save_pretrained(tmp / name)
    records = []
    engine = make_engine(model_dir, tokenizer, max_lora_rank=32, max_num_seqs=64, adapter_pool_bytes=64 * 2**20)
    with live_stack(tmp, engine=engine, max_lora_rank=32, composition_max_rank=MAX_RANK,
                    ledger_hooks=[records.append]) as server:
        services = server.services
        keys = {"acme": new_tenant_key(services, "acme", "premium"), "other": new_tenant_key(services, "other")}
        acme, other = services.tenancy.tenant("acme"), services.tenancy.tenant("other")
        for name, path in dirs.items():
            services.registry.register(acme.id, name, adapter_files(path))
        for name in ("big", "dora", "fragile"):
            services.registry.register(acme.id, name, adapter_files(tmp / name))
        services.registry.register(other.id, "secret", adapter_files(tmp / "secret"), visibility="private")
        fragile = services.registry.resolve(acme.id, "fragile")
        services.store.delete(fragile.storage_key)
        yield server, keys, records


def client(stack, who: str = "acme") -> openai.OpenAI:
    server, keys, _ = stack
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys[who], max_retries=0, timeout=120)


def _adapters(name: str) -> list[dict]:
    return [{"model": a, "weight": w} for a, w in COMPOSITIONS[name]]


def test_concurrent_compositions_and_plain_adapters_equal_peft(stack, peft_case, tokenizer):
    _, _, _, expected = peft_case
    server, _, records = stack
    c = client(stack)
    jobs = [(name, i) for name in [None, *ADAPTERS, "two", "three", "zero-weight"] for i in range(len(PROMPTS))]

    def complete(job):
        name, i = job
        extra = {"ignore_eos": True}
        if name in COMPOSITIONS:
            extra["adapters"] = _adapters(name)
        model = name if name in ADAPTERS else MODEL
        return c.completions.create(model=model, prompt=PROMPTS[i], max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body=extra)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(complete, jobs))
    for (name, i), answer in zip(jobs, answers):
        assert answer.choices[0].text == tokenizer.decode(expected[name][i]), (name, i)
        assert answer.model == (name if name in ADAPTERS else MODEL)
        ext = answer.model_extra["loramux"]
        if name in COMPOSITIONS:
            assert ext["adapter"] is None
            assert [(p["model"], p["name"], p["version"], p["weight"]) for p in ext["composition"]] == \
                [(a, a, 1, w) for a, w in COMPOSITIONS[name]]
    by_id = {r.request_id: r for r in records}
    for (name, _), answer in zip(jobs, answers):
        record = by_id[answer.id]
        if name not in COMPOSITIONS:
            assert record.composition is None
            continue
        versions = {a: server.services.registry.resolve(server.services.tenancy.tenant("acme").id, a)
                    for a, _ in COMPOSITIONS[name]}
        assert record.adapter_id is None and record.adapter_version is None and record.requested == MODEL
        assert record.composition == [{"adapter_id": versions[a].adapter_id, "version": 1,
                                       "digest": versions[a].digest, "weight": w} for a, w in COMPOSITIONS[name]]
    # Each composition was built once, however many of its requests came at once; nothing stays leased.
    assert server.app.state.pipeline.compositions.builds == 3
    wait_until(lambda: _no_leases(server), "every host-RAM lease to be given back")


def test_chat_streaming_and_native_generate_take_adapters(stack, peft_case, tokenizer):
    server, keys, _ = stack
    c = client(stack)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = c.chat.completions.create(model="base", messages=messages, max_tokens=6, temperature=0,
                                     extra_body={"adapters": _adapters("three"), "ignore_eos": True})
    assert full.model == "base"
    assert [p["name"] for p in full.model_extra["loramux"]["composition"]] == ["tone", "style", "legal"]
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"adapters": _adapters("three"),
                                                                     "ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        full.choices[0].message.content
    assert [p["name"] for p in chunks[-1].model_extra["loramux"]["composition"]] == ["tone", "style", "legal"]
    plain = c.chat.completions.create(model="tone", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != full.choices[0].message.content
    _, _, _, expected = peft_case
    native = httpx.post(f"{server.url}/generate", headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=120,
                        json={"prompt": tokenizer.decode(PROMPTS[0][1:]), "adapters": _adapters("two"),
                              "max_tokens": NEW_TOKENS, "ignore_eos": True})
    assert native.status_code == 200, native.text
    body = native.json()
    assert body["adapter"] is None and [p["weight"] for p in body["composition"]] == [0.7, 0.3]
    wait_until(lambda: _no_leases(server), "every host-RAM lease to be given back")


def _post(stack, body: dict | str, who: str = "acme") -> httpx.Response:
    server, keys, _ = stack
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/completions", content=content, timeout=120,
                      headers={"Authorization": f"Bearer {keys[who]}", "Content-Type": "application/json"})


BASE = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}


@pytest.mark.parametrize("adapters,status,fragment", [
    ([{"model": "tone", "weight": 1}] * 5, 400, "LORAMUX_COMPOSITION_MAX_ADAPTERS"),
    ([{"model": "big", "weight": 1}, {"model": "legal", "weight": 1}], 400, "LORAMUX_COMPOSITION_MAX_RANK"),
    ([{"model": "tone", "weight": "0.5"}], 400, "adapters[0].weight must be a number"),
    ([{"model": "tone", "weight": True}], 400, "adapters[0].weight must be a number"),
    ([{"model": "tone", "weight": 1e9}], 400, "adapters[0].weight must be a finite number"),
    ([{"model": "tone"}], 400, "adapters[0].weight is required"),
    ([{"model": "tone", "weight": 1, "scale": 2}], 400, "unknown field 'scale'"),
    ([{"weight": 1}], 400, "adapters[0].model must be a non-empty string"),
    (["tone"], 400, "adapters[0]: adapters must be a list"),
    ({"tone": 1}, 400, "adapters must be a list"),
    ([], 400, "adapters is empty"),
    ([{"model": "tone", "weight": 0.5}, {"model": "tone", "weight": 0.5}], 400, "list each adapter once"),
    ([{"model": "tone", "weight": 1}, {"model": "dora", "weight": 1}], 400, "'dora' cannot be combined: it is a DoRA"),
    ([{"model": "tone", "weight": 1}, {"model": "nope", "weight": 1}], 404, "adapters[1].model 'nope' not found"),
    ([{"model": "other/secret", "weight": 1}], 404, "adapters[0].model 'other/secret' not found"),
    ([{"model": "tone", "weight": 1}, {"model": "fragile", "weight": 1}], 503, "fragile@1 could not be loaded"),
])
def test_refusals_say_what_to_fix_and_hold_nothing(stack, adapters, status, fragment):
    server, _, records = stack
    before = len(records)
    resp = _post(stack, {**BASE, "adapters": adapters})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["param"] == "adapters"
    assert len(records) == before  # a refused request is not billed
    wait_until(lambda: _no_leases(server), "every host-RAM lease to be given back")
    assert server.services.engine.stats()["adapter_slots_pinned"] == 0


def test_model_must_be_the_base_and_weights_must_be_finite(stack):
    resp = _post(stack, {**BASE, "model": "tone", "adapters": _adapters("two")})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert "`model` must be the base model" in resp.json()["error"]["message"]
    for literal in ("NaN", "Infinity", "-Infinity"):  # JSON extensions Python's parser takes: still a 400
        body = json.dumps({**BASE, "adapters": [{"model": "tone", "weight": 0}]}).replace('"weight": 0', f'"weight": '
                                                                                         f'{literal}')
        resp = _post(stack, body)
        assert resp.status_code == 400 and "finite" in resp.json()["error"]["message"], resp.text
    with pytest.raises(openai.BadRequestError, match="LORAMUX_COMPOSITION_MAX_RANK"):
        client(stack).completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={
            "adapters": [{"model": "big", "weight": 0.5}, {"model": "legal", "weight": 0.5}]})


def _register_scaled_tone(server, peft_case, path, name: str, which: str, factor: float) -> None:
    """Register for acme, as `name`, the case's `tone` adapter with its `which` ("lora_A" / "lora_B") tensors
    multiplied by `factor`, written to `path`."""
    from safetensors.torch import load_file, save_file

    _, dirs, _, _ = peft_case
    tensors = {k: v * (factor if which in k else 1.0)
               for k, v in load_file(dirs["tone"] / "adapter_model.safetensors").items()}
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_bytes((dirs["tone"] / "adapter_config.json").read_bytes())
    server.services.registry.register(server.services.tenancy.tenant("acme").id, name, adapter_files(path))


def test_a_composition_is_built_once_and_a_new_version_makes_a_new_one(stack, peft_case, tmp_path):
    server, _, _ = stack
    compositions = server.app.state.pipeline.compositions
    c = client(stack)
    weights = [{"model": "tone", "weight": 0.25}, {"model": "style", "weight": 0.75}]

    def ask():
        return c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                    extra_body={"adapters": weights, "ignore_eos": True})

    first = ask()
    built = compositions.builds
    assert ask().choices[0].text == first.choices[0].text and compositions.builds == built  # from the LRU
    # A new version of a component is a new composition (its digest is in the key), never a stale copy.
    _register_scaled_tone(server, peft_case, tmp_path / "tone2", "tone", "lora_B", 3.0)
    newer = ask()
    assert [p["version"] for p in newer.model_extra["loramux"]["composition"]] == [2, 1]
    assert compositions.builds == built + 1
    wait_until(lambda: _no_leases(server), "every host-RAM lease to be given back")


def test_the_ledger_row_is_priced_at_the_costliest_components_admin_set_price(stack):
    """Through the real ledger writer (SQLite): admins price a composition with ordinary adapter prices."""
    from datetime import timedelta

    from sqlalchemy import select

    from loramux.db.models import LedgerEntry, utcnow

    server, _, _ = stack
    services = server.services
    acme = services.tenancy.tenant("acme")
    legal = services.registry.resolve(acme.id, "legal")
    since = utcnow() - timedelta(seconds=5)
    base = services.prices.set_price(MODEL, "1", "0.5", "1", effective_from=since)
    priced = services.prices.set_price(MODEL, "2", "1", "40", adapter_id=legal.adapter_id, effective_from=since)
    answer = client(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                              extra_body={"adapters": _adapters("two"), "ignore_eos": True})

    def row():
        with services.db.session() as session:
            return session.execute(select(LedgerEntry).where(LedgerEntry.request_id == answer.id)).scalar_one_or_none()

    entry = wait_until(row, "the request's ledger row")
    assert entry.adapter_id is None and entry.price_id == priced.id != base.id
    assert entry.output_per_mtok == priced.output_per_mtok
    assert [(c["adapter_id"], c["weight"]) for c in entry.composition] == \
        [(services.registry.resolve(acme.id, a).adapter_id, w) for a, w in COMPOSITIONS["two"]]


def test_a_composite_beyond_what_the_adapter_pools_dtype_holds_is_a_400_naming_the_module(stack, peft_case, tmp_path,
                                                                                         monkeypatch):
    """On a float16 pool a weighted A of 1e5 would be loaded as inf (every token NaN): refused, naming the
    module and the dtype, with nothing held; the same adapter at a weight whose product fits is served."""
    import torch

    server, _, records = stack
    _register_scaled_tone(server, peft_case, tmp_path / "loud", "loud", "lora_A", 100.0)
    monkeypatch.setattr(server.app.state.pipeline, "adapter_dtype", torch.float16)
    before = len(records)
    resp = _post(stack, {**BASE, "adapters": [{"model": "loud", "weight": 1000}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "adapters" and "float16 adapter pool" in error["message"], error
    assert "lower the weights" in error["message"] and len(records) == before
    wait_until(lambda: _no_leases(server), "every host-RAM lease to be given back")
    assert _post(stack, {**BASE, "adapters": [{"model": "loud", "weight": 0.01}]}).status_code == 200
