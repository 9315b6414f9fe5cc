"""HTTP app and async engine on a tiny random Llama."""
from __future__ import annotations

import asyncio
import json

import pytest

from conftest import live_stack, make_engine, new_tenant_key, server_stats
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.engine import RequestError
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams


@pytest.fixture
def client(tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, client=True) as c:
        c.headers["Authorization"] = f"Bearer {new_tenant_key(c.app.state.services)}"
        yield c


def test_health_ready_stats(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["status"] == "ready"
    assert server_stats(client)["kv_blocks_used"] == 0
    assert "loramux_requests_total" in client.get("/metrics").text


def test_engine_wide_stats_are_for_operators_only(client):
    assert client.get("/stats").status_code == 404  # no tenant-visible route shows other tenants' load
    assert client.get("/admin/stats").status_code == 403
    assert set(server_stats(client)) >= {"running", "waiting", "kv_blocks_used", "adapter_cache"}


def test_tenant_routes_need_a_valid_key(client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer lmx-not-a-real-key"},
                    {"Authorization": "Basic abc"}):
        resp = client.post("/generate", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200


def test_generate_plain_and_streamed_agree(client):
    body = {"prompt": "Hello there", "max_tokens": 8}
    plain = client.post("/generate", json=body)
    assert plain.status_code == 200, plain.text
    result = plain.json()
    assert result["usage"]["completion_tokens"] <= 8 and result["finish_reason"] in ("stop", "length")
    assert result["timings"]["ttft_ms"] > 0

    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    chunks = "".join(json.loads(e)["text"] for e in events[:-2])
    assert chunks == final["text"] == result["text"]


def test_chat_messages_use_the_template(client):
    resp = client.post("/generate", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] > 5  # template tokens around "Hi"


@pytest.mark.parametrize("body,status,needle", [
    ({"max_tokens": 3}, 422, "exactly one of"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 422, "exactly one of"),
    ({"prompt": "x", "top_p": 0}, 422, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "x", "stop": [""]}, 400, "stop string"),
    ({"prompt": "word " * 600}, 400, "prompt tokens"),
])
def test_bad_input_gets_a_clear_error(client, body, status, needle):
    resp = client.post("/generate", json=body)
    assert resp.status_code == status, resp.text
    assert needle in resp.text
    assert server_stats(client)["kv_blocks_used"] == 0


def test_a_failed_step_tells_each_request_only_about_itself(tiny_dir, tokenizer, monkeypatch):
    from loramux.engine.async_engine import EngineStepError

    llm = make_engine(tiny_dir, tokenizer)
    real_step = llm.step

    def failing_step():
        if len(llm.requests) == 2:  # both requests are in flight
            raise RuntimeError("tenant-a's prompt 'the secret plan' broke the sampler")
        return real_step()

    monkeypatch.setattr(llm, "step", failing_step)
    engine = AsyncEngine(llm)

    async def run(request_id):
        try:
            request = EngineRequest(request_id, "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
            async for _ in engine.generate(request):
                pass
        except EngineStepError as exc:
            return str(exc)

    async def scenario():
        return await asyncio.gather(run("req-a"), run("req-b"))

    try:
        errors = asyncio.run(scenario())
        for request_id, message in zip(("req-a", "req-b"), errors):
            assert message is not None and request_id in message and "secret" not in message, errors
        assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0
    finally:
        engine.shutdown()


def test_async_stream_and_early_exit_abort(tiny_dir, tokenizer):
    engine = AsyncEngine(make_engine(tiny_dir, tokenizer))

    async def scenario():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        got = 0
        async for _out in engine.generate(EngineRequest("a", "Hello", params)):
            got += 1
            if got == 3:
                break  # the consumer walks away: the request must be aborted
        with pytest.raises(RequestError):
            async for _ in engine.generate(EngineRequest("b", [], params)):
                pass
        last = EngineRequest("c", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
        outs = [o async for o in engine.generate(last)]
        return got, outs

    try:
        got, outs = asyncio.run(scenario())
        assert got == 3 and outs[-1].finished and len(outs[-1].token_ids) == 4
        # The abort is processed by the engine thread before it serves "c", so all is free by now.
        assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0
    finally:
        engine.shutdown()


def test_generate_with_adapter_over_http(tiny_dir, tokenizer, tmp_path):
    from loramux.model.loader import read_model_config
    from loramux.testing import write_peft_adapter

    cfg, _ = read_model_config(tiny_dir)
    path = write_peft_adapter(tmp_path / "a", cfg, 4, ["q_proj", "v_proj", "down_proj"], seed=1, b_std=1.0)

    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_loras=2, max_lora_rank=8), client=True,
                    adapters=f"tuned={path}") as client:
        client.headers["Authorization"] = f"Bearer {new_tenant_key(client.app.state.services)}"
        listed = client.get("/adapters").json()["adapters"]
        assert [a["name"] for a in listed] == ["tuned"] and listed[0]["rank"] == 4
        body = {"prompt": "Hello there", "max_tokens": 8}
        base = client.post("/generate", json=body).json()
        tuned = client.post("/generate", json={**body, "adapter": "tuned"}).json()
        assert tuned.get("adapter") == "tuned" and base["adapter"] is None, tuned
        assert (tuned["adapter_version"], tuned["adapter_tier"]) == (1, "store")  # first use: from the store
        assert tuned["text"] != base["text"]
        again = client.post("/generate", json={**body, "adapter": f"{listed[0]['id']}@1"}).json()
        assert again["text"] == tuned["text"] and again["adapter_tier"] == "ram"
        missing = client.post("/generate", json={**body, "adapter": "nope"})
        assert missing.status_code == 404 and "model 'nope' not found" in missing.text
        stats = server_stats(client)
        assert stats["adapter_slots_pinned"] == 0 and stats["adapter_cache"]["hits"] == {"store": 1, "ram": 1}


def test_adapters_setting_parses_and_rejects_bad_entries():
    from loramux.settings import Settings

    assert Settings(adapters="a=/x, b = /y ").adapter_dirs() == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="name=/path/to/adapter"):
        Settings(adapters="oops").adapter_dirs()


def test_each_tenant_is_charged_its_tokens_over_its_tier_weight(tiny_dir, tokenizer, tmp_path):
    """The fair-share counters the scheduler keeps per tenant: prompt tokens + 2 x completion tokens (the
    default weights), divided by the tenant's tier weight (LORAMUX_FAIR_SHARE_TIER_WEIGHTS)."""
    with live_stack(tmp_path, tiny_dir, tokenizer, client=True, metrics_key="scrape-key",
                    fair_share_tier_weights={"premium": 2.0}) as client:
        services = client.app.state.services
        usage = {}
        for name, tier in (("acme", "standard"), ("globex", "premium")):
            key = new_tenant_key(services, name, tier)
            resp = client.post("/generate", json={"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True},
                               headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
            tenant_id = services.tenancy.authenticate(key).tenant_id
            usage[tenant_id] = (resp.json()["usage"], 2.0 if tier == "premium" else 1.0)
        shares = server_stats(client)["fair_share"]
        for tenant_id, (used, weight) in usage.items():
            expected = (used["prompt_tokens"] - used.get("cached_tokens", 0) + 2 * used["completion_tokens"]) / weight
            assert shares[tenant_id]["service"] == pytest.approx(expected)
        # Behind the metrics key, Prometheus has the same per tenant (an open /metrics names none).
        metrics = client.get("/metrics", headers={"Authorization": "Bearer scrape-key"}).text
        for tenant_id in usage:
            assert f'loramux_fair_share_service_tokens_total{{tenant="{tenant_id}"}} ' \
                   f'{shares[tenant_id]["service"]}' in metrics
