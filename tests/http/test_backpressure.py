"""Bounded memory per request: the engine emits deltas (not a copy of the state per step), and the async
engine buffers a bounded number of outputs per reader, aborting requests whose reader stalls."""
from __future__ import annotations

import asyncio
import sys

import pytest

from conftest import make_engine
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.outputs import RequestOutput, SoFar
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams
from loramux.testing import save_tiny_hf_model
from polling import wait_until, wait_until_async

LONG = 4000


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama whose context holds a 4,000-token answer."""
    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny_hf_model(path, vocab_size=len(tokenizer), max_position_embeddings=LONG + 512)
    return path


def long_engine(path, tokenizer, **config):
    return make_engine(path, tokenizer, num_blocks=(LONG + 512) // 16 + 8, max_model_len=LONG + 512, **config)


def test_stalled_reader_is_cancelled_with_bounded_buffer(long_dir, tokenizer):
    engine = AsyncEngine(long_engine(long_dir, tokenizer), stalled_reader_timeout_s=0.3, max_buffered_outputs=4)
    params = SamplingParams(max_tokens=LONG, ignore_eos=True)

    async def scenario():
        stream = engine.generate(EngineRequest("slow", "Hello there", params))
        first = await anext(stream)  # ... and then the reader stops reading
        peak = {"outputs": 0}

        def sample():
            peak["outputs"] = max(peak["outputs"], engine.stats()["buffered_outputs"])

        def cancelled():
            s = engine.stats()
            return s["stalled_reader_aborts"] == 1 and s["running"] == 0 and s["kv_blocks_used"] == 0

        await wait_until_async(cancelled, "the stalled reader's request to be cancelled", 60, every=sample)
        buffered = engine.stats()
        rest = [out async for out in stream]  # the reader comes back
        return first, peak["outputs"], buffered, rest, engine.stats()

    try:
        first, peak, buffered, rest, after = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert first.new_token_ids and not first.finished
    # Never more than the bound of separate outputs, however many steps ran while nobody read.
    assert 1 <= peak <= 4 and buffered["buffered_outputs"] <= 4
    final = rest[-1]
    assert final.finished and final.finish_reason == "cancelled" and all(not o.finished for o in rest[:-1])
    generated = len(final.token_ids)  # usage of a cancelled request: every token generated so far
    assert 1 < generated < LONG and buffered["buffered_tokens"] == generated - 1
    assert [t for o in [first, *rest] for t in o.new_token_ids] == list(final.token_ids)
    assert [lp for o in [first, *rest] for lp in o.new_logprobs] == list(final.logprobs)
    assert "".join(o.delta_text for o in [first, *rest]) == final.text
    assert after["buffered_outputs"] == 0 and after["buffered_tokens"] == 0 and after["kv_blocks_used"] == 0


def test_lagging_reader_gets_coalesced_outputs_with_everything(long_dir, tokenizer):
    """A reader that falls far behind (but within the stall timeout) holds a bounded number of outputs,
    and still reads every token, logprob and character the engine produced."""
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    reference = long_engine(long_dir, tokenizer).generate(["Hello there"], params)[0]
    engine = AsyncEngine(long_engine(long_dir, tokenizer), stalled_reader_timeout_s=600, max_buffered_outputs=3)

    async def scenario():
        stream = engine.generate(EngineRequest("lag", "Hello there", params))
        first = await anext(stream)
        peak = {"outputs": 0}

        def sample():
            peak["outputs"] = max(peak["outputs"], engine.stats()["buffered_outputs"])

        # Done while nobody read: the request has left the batch and its last output is buffered (the
        # engine thread finishes a request before it hands over that step's outputs).
        await wait_until_async(lambda: engine.stats()["running"] == 0 and engine.stats()["buffered_tokens"] == 119,
                               "the unread request to finish with its 119 tokens buffered", 60, every=sample)
        waiting = engine.stats()
        return first, peak["outputs"], waiting, [out async for out in stream]

    try:
        first, peak, waiting, rest = asyncio.run(scenario())
    finally:
        engine.shutdown()
    outs = [first, *rest]
    assert peak <= 3 and waiting["buffered_outputs"] == len(rest) <= 3 and waiting["buffered_tokens"] == 119
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    assert [t for o in outs for t in o.new_token_ids] == reference.token_ids == rest[-1].token_ids
    assert [lp for o in outs for lp in o.new_logprobs] == pytest.approx(reference.logprobs)
    assert "".join(o.delta_text for o in outs) == reference.text == rest[-1].text


def _footprint(out: RequestOutput) -> int:
    return sys.getsizeof(out.token_ids) + sys.getsizeof(out.logprobs) + sys.getsizeof(out.text)


@pytest.mark.parametrize("speculative", [0, 3])
def test_step_outputs_do_not_grow_with_the_output(tiny_engine, tiny_dir, tokenizer, speculative):
    engine = make_engine(tiny_dir, tokenizer, speculative_tokens=speculative) if speculative else tiny_engine
    engine.add_request("r", "the cat sat on the mat, the cat sat on the", SamplingParams(max_tokens=200,
                                                                                        ignore_eos=True))
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    *steps, final = outs
    assert final.finished and len(final.token_ids) == len(final.logprobs) == 200
    if speculative:
        assert engine.stats()["spec_accepted_tokens"] > 0  # some steps folded several tokens (absorb)
    # Intermediate outputs are the same size at the first step and at the last one: no copies of the
    # tokens, logprobs or text so far ...
    assert len({_footprint(o) for o in steps}) == 1 and all(o.text == "" for o in steps)
    # ... yet they still say how many tokens there are so far (what usage counts if it is the last seen).
    count = 0
    for out in steps:
        count += len(out.new_token_ids)
        assert len(out.new_logprobs) == len(out.new_token_ids) >= 1
        assert isinstance(out.token_ids, SoFar) and len(out.token_ids) == len(out.logprobs) == count
        assert out.token_ids == final.token_ids[:count] and list(out.logprobs) == final.logprobs[:count]
        assert out.token_ids[-1] == final.token_ids[count - 1]
        assert out.token_ids[-2:] == final.token_ids[max(0, count - 2):count]
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert [lp for o in outs for lp in o.new_logprobs] == final.logprobs
    assert "".join(o.delta_text for o in outs) == final.text


def test_fast_reader_gets_every_token_and_the_same_text(tiny_dir, tokenizer):
    prompts = ["Hello there", "東京は🦙", "The capital of France"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = make_engine(tiny_dir, tokenizer).generate(prompts, params)
    engine = AsyncEngine(make_engine(tiny_dir, tokenizer), stalled_reader_timeout_s=60)

    async def read(i):
        return [out async for out in engine.generate(EngineRequest(f"r{i}", prompts[i], params))]

    async def scenario():
        return await asyncio.gather(*(read(i) for i in range(len(prompts))))

    try:
        results = asyncio.run(scenario())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["buffered_outputs"] == 0 and stats["stalled_reader_aborts"] == 0
    for ref, outs in zip(reference, results):
        final = outs[-1]
        assert final.finished and final.finish_reason == "length" and all(not o.finished for o in outs[:-1])
        assert final.token_ids == ref.token_ids and final.text == ref.text
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert [lp for o in outs for lp in o.new_logprobs] == pytest.approx(ref.logprobs)
        assert "".join(o.delta_text for o in outs) == ref.text


def test_an_aborted_request_reports_the_tokens_so_far(tiny_engine):
    tiny_engine.add_request("a", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        last = tiny_engine.step()[-1]
    assert len(last.token_ids) == 4 and not last.finished
    out = tiny_engine.abort_request("a")
    assert out.finished and out.finish_reason == "cancelled" and len(out.token_ids) == len(out.logprobs) == 4
    assert out.text and out.new_token_ids == [] and out.new_logprobs == []


def test_settings_pass_the_stall_timeout(tiny_engine, tmp_path, monkeypatch):
    from conftest import make_services

    monkeypatch.setenv("LORAMUX_STALLED_READER_TIMEOUT_S", "2.5")
    services = make_services(tmp_path, tiny_engine)
    try:
        assert services.settings.stalled_reader_timeout_s == 2.5 == services.engine.stalled_reader_timeout_s
    finally:
        services.shutdown()
    with pytest.raises(ValueError):
        AsyncEngine(tiny_engine, stalled_reader_timeout_s=0)


def test_a_client_that_never_reads_a_4000_token_stream_is_cancelled_and_billed(long_dir, tokenizer, tmp_path):
    """Through the whole server: the client takes the response's first chunk and then never reads again
    (its `send` never returns) nor disconnects. The request is aborted after the stall timeout, its KV
    blocks, adapter pin and rate-limit slot are given back, and its ledger row counts what was generated,
    although the stuck stream itself never resumes."""
    import json

    import anyio
    from fastapi.testclient import TestClient

    from conftest import make_services, new_tenant_key
    from loramux.server.app import create_app

    records = []
    app = create_app(lambda: make_services(tmp_path, long_engine(long_dir, tokenizer), stalled_reader_timeout_s=0.3),
                     ledger_hooks=[records.append])
    with TestClient(app) as client:
        services = app.state.services
        key = new_tenant_key(services, "slow-reader", "free")  # free: 4 concurrent requests at most
        body = json.dumps({"model": "base", "prompt": "Count:", "max_tokens": LONG, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        chunks = []

        async def never_reading_client():
            never = anyio.Event()
            delivered = False

            async def receive():
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await never.wait()  # nor does it ever disconnect

            async def send(message):
                if message["type"] == "http.response.body" and message.get("body"):
                    chunks.append(message["body"])
                    if len(chunks) >= 2:
                        await never.wait()  # stops reading: the server's send never returns

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
                     "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]}
            await app(scope, receive, send)

        stuck = client.portal.start_task_soon(never_reading_client)
        try:
            # The ledger row appears once the server has let the request go.
            wait_until(lambda: records, "the stalled request's ledger record", 30, detail=services.engine.stats)
        except BaseException:
            stuck.cancel()
            raise
        stats = services.engine.stats()
        assert stats["stalled_reader_aborts"] == 1 and stats["running"] == 0 and stats["kv_blocks_used"] == 0
        assert stats["buffered_outputs"] <= services.engine.max_buffered_outputs + 1
        (record,) = records
        assert record.outcome == "cancelled" and 0 < record.completion_tokens < LONG
        assert app.state.pipeline.limiter.in_flight(record.tenant_id) == 0  # its concurrency slot came back
        resp = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "base", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        assert not stuck.done()  # the stuck stream itself never resumed
        stuck.cancel()
