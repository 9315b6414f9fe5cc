"""The tenant API over real HTTP: a uvicorn server on 127.0.0.1 driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
import pytest

from conftest import adapter_files, live_stack, new_tenant_key
from loramux.model.loader import read_model_config
from loramux.tenancy.tenants import TierInfo
from loramux.testing import write_peft_adapter
from polling import wait_until

ADAPTERS = ("alpha", "beta", "gamma", "delta")


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    """One server for the module: tenants on each tier, four public adapters of tenant `acme`, and a
    ledger hook that records every finished request."""
    tmp = tmp_path_factory.mktemp("openai-api")
    cfg, _ = read_model_config(tiny_dir)
    records = []
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_loras=4, max_lora_rank=16, max_num_seqs=32),
                    ledger_hooks=[records.append]) as server:
        services = server.services
        keys = {tier: new_tenant_key(services, f"{tier}-co", tier) for tier in ("free", "standard", "premium")}
        keys["acme"] = new_tenant_key(services, "acme", "standard")
        acme = services.tenancy.tenant("acme")
        for i, name in enumerate(ADAPTERS):
            path = write_peft_adapter(tmp / name, cfg, 4 * (i + 1), ["q_proj", "v_proj", "down_proj"], seed=i,
                                      b_std=1.0)
            files = adapter_files(path)
            services.registry.register(acme.id, name, files, visibility="public" if name != "delta" else "private")
        yield server, keys, records


def client(stack, who: str = "acme", **kwargs) -> openai.OpenAI:
    server, keys, _ = stack
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys[who], max_retries=0, **kwargs)


def aclient(stack, who: str) -> openai.AsyncOpenAI:
    server, keys, _ = stack
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=keys[who], max_retries=0, timeout=120)


MODEL = "SmolLM2-135M-Instruct"  # the base model's id (the tiny test model is served under the default name)
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_chat_streamed_and_not_agree_and_carry_usage(stack):
    c = client(stack)
    full = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.completion_tokens <= 12 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    ext = full.model_extra["loramux"]
    assert ext["ttft_ms"] > 0 and ext["queue_ms"] >= 0 and ext["tier"] == "standard"

    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_completions_max_tokens_stop_and_logprobs(stack):
    c = client(stack)
    out = c.completions.create(model="base", prompt="Once upon a time", max_tokens=7, temperature=0,
                               extra_body={"ignore_eos": True}, logprobs=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 7
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 7 and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    words = out.choices[0].text.split()
    assert words, out.choices[0].text
    stop = words[len(words) // 2]
    stopped = c.completions.create(model="base", prompt="Once upon a time", max_tokens=7, temperature=0,
                                   stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert out.choices[0].text.startswith(stopped.choices[0].text)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="base", prompt="Once upon a time", max_tokens=7, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == out.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True)
    entries = chat.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == chat.choices[0].message.content


def test_seed_reproduces_sampled_output(stack):
    c = client(stack)
    kwargs = dict(model="alpha", messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95,
                  extra_body={"top_k": 50, "ignore_eos": True})
    first = c.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert c.chat.completions.create(seed=7, **kwargs).choices[0].message.content == first
    others = {c.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (8, 9, 10)}
    assert others - {first}


def test_adapters_change_output_and_models_are_listed_per_tenant(stack):
    c = client(stack)
    ids = [m.id for m in c.models.list().data]
    assert ids[0] == MODEL and set(ADAPTERS) <= set(ids)
    outputs = {name: c.chat.completions.create(model=name, messages=CHAT, max_tokens=8, temperature=0)
               for name in (MODEL, *ADAPTERS)}
    assert len({o.choices[0].message.content for o in outputs.values()}) >= 4
    ext = outputs["beta"].model_extra["loramux"]["adapter"]
    assert ext["name"] == "beta" and ext["version"] == 1 and ext["cache_tier"] in ("store", "disk", "ram")
    # Another tenant sees acme's public adapters as acme/<name>, and not the private one.
    other = [m.id for m in client(stack, "free").models.list().data]
    assert {"acme/alpha", "acme/beta", "acme/gamma"} <= set(other) and not any("delta" in m for m in other)
    assert client(stack, "free").chat.completions.create(model="acme/alpha", messages=CHAT, max_tokens=8,
                                                         temperature=0).choices[0].message.content == \
        outputs["alpha"].choices[0].message.content


def test_errors_have_the_right_status_and_say_what_to_fix(stack):
    c = client(stack)
    with pytest.raises(openai.NotFoundError, match="model 'nope' not found"):
        c.chat.completions.create(model="nope", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.NotFoundError):  # private to acme: the same 404 as unknown
        client(stack, "free").chat.completions.create(model="acme/delta", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        c.chat.completions.create(model=MODEL, messages=CHAT, temperature=5)
    with pytest.raises(openai.UnprocessableEntityError, match="messages"):
        c.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="tier 'standard' allows at most 8 choices"):
        c.chat.completions.create(model=MODEL, messages=CHAT, n=9)
    with pytest.raises(openai.BadRequestError, match="tier 'free' allows at most 2 choices"):
        client(stack, "free").completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3)
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="'g', which is not in tools"):
        c.chat.completions.create(model=MODEL, messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.BadRequestError, match="maximum of tier"):
        c.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"timeout_s": 10_000})
    server, _, _ = stack
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="lmx-wrong", max_retries=0).models.list()
    resp = httpx.get(f"{server.url}/v1/models")
    assert resp.status_code == 401 and "missing API key" in resp.json()["error"]["message"]


def test_rate_limits_answer_429_with_retry_after(stack):
    server, keys, _ = stack
    services = server.services
    services.tenancy.upsert_tier(TierInfo("trial", 0, requests_per_min=2, tokens_per_min=0, max_concurrent=0,
                                          default_timeout_s=30, max_timeout_s=60))
    key = new_tenant_key(services, "trial-co", "trial")
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    for _ in range(2):
        c.completions.create(model="base", prompt="hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model="base", prompt="hi", max_tokens=2)
    assert "2 requests per minute" in str(info.value)
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_suspended_tenant_is_refused(stack):
    server, _, _ = stack
    services = server.services
    key = new_tenant_key(services, "gone-co", "standard")
    services.tenancy.set_tenant(services.tenancy.tenant("gone-co").id, status="suspended")
    with pytest.raises(openai.PermissionDeniedError, match="suspended"):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0).models.list()


def test_mixed_load_matches_each_request_run_alone(stack):
    """32 concurrent streaming clients over 3 tiers, 4 adapters and the base model: every greedy
    response equals the same request run alone."""
    plan = []
    tiers = ["free"] * 4 + ["standard"] * 14 + ["premium"] * 14
    models = ["acme/alpha", "acme/beta", "acme/gamma", MODEL, "base"]
    for i, tier in enumerate(tiers):
        model = models[i % len(models)]
        prompt = [{"role": "user", "content": f"Question {i}: what is {i} plus {i % 7}?"}]
        plan.append((tier, model, prompt, 6 + i % 11))

    async def run(tier, model, messages, max_tokens):
        stream = await aclient(stack, tier).chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def alone():
        return [await run(*p) for p in plan]

    async def together():
        return await asyncio.gather(*(run(*p) for p in plan))

    solo = asyncio.run(alone())
    mixed = asyncio.run(together())
    assert mixed == solo
    server, _, _ = stack
    stats = server.services.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0


def test_every_finished_request_reaches_the_ledger_hook(stack):
    _, _, records = stack
    before = len(records)
    c = client(stack)
    out = c.chat.completions.create(model="gamma", messages=CHAT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    record = records[before]
    assert record.request_id == out.id and record.outcome == "length" and record.tier == "standard"
    assert (record.prompt_tokens, record.completion_tokens) == (out.usage.prompt_tokens, 5)
    assert record.adapter_id.startswith("ad_") and record.adapter_version == 1 and not record.fallback
    assert record.key_id.startswith("key_") and record.total_ms > 0


def requests_counted(server, outcome: str, tier: str) -> float:
    """The value of `loramux_requests_total{outcome=..., tier=...}` on /metrics, fetched without a key."""
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.status_code == 200
    series = f'loramux_requests_total{{outcome="{outcome}",tier="{tier}"}} '
    return float(next(line for line in resp.text.splitlines() if line.startswith(series))[len(series):])


def test_metrics_are_exposed_without_a_key_and_without_tenant_labels(stack):
    server, _, _ = stack
    before = requests_counted(server, "length", "standard")
    client(stack).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True})  # acme is on the standard tier
    wait_until(lambda: requests_counted(server, "length", "standard") > before, "the request to be counted", 10)
    assert requests_counted(server, "length", "standard") == before + 1
    text = httpx.get(f"{server.url}/metrics").text
    assert "loramux_ttft_seconds_bucket" in text and "loramux_kv_cache_usage_ratio" in text
    assert "acme" not in text and "tenant" not in text


# -- saturation, timeouts, disconnects: a small engine (2 sequences at once) ------------------------------

@pytest.fixture
def small(tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_num_seqs=2, max_num_batched_tokens=64)) as server:
        keys = {tier: new_tenant_key(server.services, f"{tier}-co", tier) for tier in ("free", "standard", "premium")}
        cfg, _ = read_model_config(tiny_dir)
        path = write_peft_adapter(tmp_path / "tuned", cfg, 4, ["q_proj", "v_proj"], seed=11)
        server.services.registry.register(server.services.tenancy.tenant("standard-co").id, "tuned",
                                          adapter_files(path))
        yield server, keys


def engine_is_idle(server) -> bool:
    stats = server.services.engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


def test_under_saturation_premium_waits_less_and_nobody_starves(small):
    server, keys = small

    async def one(tier, i):
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=keys[tier], max_retries=0, timeout=120)
        out = await c.completions.create(model="base", prompt=f"Request {i} from {tier}", max_tokens=24,
                                         temperature=0, extra_body={"ignore_eos": True})
        return tier, out.model_extra["loramux"]["queue_ms"]

    async def burst():
        jobs = [one(tier, i) for i in range(4) for tier in ("free", "premium")]  # free's limit: 4 at once
        return await asyncio.gather(*jobs)

    results = asyncio.run(burst())
    queue = {t: [q for tier, q in results if tier == t] for t in ("free", "premium")}
    assert len(queue["free"]) == 4 and len(queue["premium"]) == 4  # everyone finished
    assert statistics.median(queue["premium"]) < statistics.median(queue["free"])


def test_timeout_returns_partial_output_streamed_or_not(small):
    server, keys = small
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["standard"], max_retries=0)
    kwargs = dict(model="base", prompt="Count:", max_tokens=400, temperature=0,
                  extra_body={"ignore_eos": True, "timeout_s": 0.3})
    out = c.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "timeout" and 0 < out.usage.completion_tokens < 400
    chunks = list(c.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "timeout"
    assert "".join(ch.choices[0].text for ch in chunks)
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 10, detail=server.services.engine.stats)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(small, stream):
    server, keys = small
    body = {"model": "tuned", "prompt": "Count:", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    headers = {"Authorization": f"Bearer {keys['standard']}"}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(3))]
            assert got and not engine_is_idle(server)  # running while we read
            assert server.services.engine.stats()["adapter_slots_pinned"] == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.2)
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 5, detail=server.services.engine.stats)
    assert server.services.engine.stats()["adapter_slots_pinned"] == 0


def test_a_queue_that_cannot_meet_the_deadline_answers_503(small):
    server, keys = small
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["standard"], max_retries=0)
    for _ in range(2):  # teach the engine how long a request takes here
        c.completions.create(model="base", prompt="warm", max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    long = {"model": "base", "prompt": "Count:", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {keys['standard']}"}
    engine = server.services.engine
    llm, resume = engine.engine, threading.Event()
    real_step = llm.step

    def step_until_the_batch_is_full():
        # Hold the engine once both long requests run, so they cannot finish (a fast machine does 500 tiny-model
        # tokens in about a second) while the urgent request is judged.
        if len(llm.scheduler.running) == 2:
            resume.wait(30)
        return real_step()

    llm.step = step_until_the_batch_is_full
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, headers=headers, timeout=30) as a, \
                httpx.stream("POST", f"{server.url}/v1/completions", json=long, headers=headers, timeout=30) as b:
            next(a.iter_lines()), next(b.iter_lines())
            wait_until(lambda: engine.stats()["running"] == 2, "the batch (2) to be full", 10, detail=engine.stats)
            assert engine.estimated_queue_wait_s() > 0.001, (engine.stats(), llm.counters.service_s_ewma)
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="base", prompt="urgent", max_tokens=4, extra_body={"timeout_s": 0.001})
            assert info.value.status_code == 503 and "estimated queue wait" in str(info.value)
            assert int(info.value.response.headers["retry-after"]) >= 1
            resume.set()
    finally:
        resume.set()
        llm.step = real_step
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 10, detail=server.services.engine.stats)


def test_adapter_fallback_serves_the_base_model_when_opted_in(small, tmp_path, tiny_dir):
    server, keys = small
    services = server.services
    cfg, _ = read_model_config(tiny_dir)
    path = write_peft_adapter(tmp_path / "broken", cfg, 4, ["q_proj"], seed=3)
    tenant = services.tenancy.tenant("standard-co")
    version = services.registry.register(tenant.id, "broken", adapter_files(path))
    services.store.delete(version.storage_key)  # the blob is gone: loading fails
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["standard"], max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model="broken", prompt="hi", max_tokens=3)
    assert info.value.status_code == 503 and "broken@1 could not be loaded" in str(info.value)
    services.tenancy.set_tenant(tenant.id, fallback="base")
    raw = c.completions.with_raw_response.create(model="broken", prompt="hi", max_tokens=3, temperature=0)
    out = raw.parse()
    assert out.model_extra["loramux"]["fallback"]["requested"] == "broken"
    assert out.model_extra["loramux"]["adapter"] is None and raw.headers["x-loramux-fallback"] == "base"
    base = c.completions.create(model="base", prompt="hi", max_tokens=3, temperature=0)
    assert out.choices[0].text == base.choices[0].text


def test_a_request_whose_stream_never_starts_is_still_cleaned_up(small):
    """A client gone before the first chunk: the body generator never runs, so its `finally` cannot
    clean up; RunningStreamingResponse does (engine request aborted, rate-limit slot and ledger done)."""
    from starlette.requests import ClientDisconnect

    from loramux.engine.sampling.params import SamplingParams
    from loramux.server.routes.responses import RunningStreamingResponse
    from loramux.server.serving.pipeline import Target

    server, keys = small
    services, front = server.services, server.app.state.pipeline
    tenant = services.tenancy.authenticate(keys["standard"])

    async def scenario():
        ids = services.engine.engine.tokenizer.encode("Count:")
        admitted = await front.admit(tenant, None, len(ids) + 500, time.monotonic())
        running = await front.launch(admitted, Target("tuned"), ids,
                                     SamplingParams(max_tokens=500, ignore_eos=True), "never-read")
        assert front.limiter.in_flight(tenant.tenant_id) == 1

        async def body():
            yield "never sent"

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("client went away")  # fails on the very first message (the headers)

        response = RunningStreamingResponse(body(), running, media_type="text/event-stream")
        with pytest.raises((OSError, ClientDisconnect)):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return running

    running = asyncio.run(scenario())
    assert running._ended and front.limiter.in_flight(tenant.tenant_id) == 0
    wait_until(lambda: engine_is_idle(server), "the engine to go idle", 10, detail=services.engine.stats)
    assert services.engine.stats()["adapter_slots_pinned"] == 0
