"""Requests' own Medusa heads on the device (`loramux.engine.speculation.medusa_device_cache`): their bytes stay within
LORAMUX_MEDUSA_DEVICE_BYTES whatever the number of digests in use (a set that does not fit runs its request
without heads, with the same output), a released set stays cached (no rebuild), the device copy is made off the
engine thread while other requests keep stepping, and a failed copy (out of memory) runs the request without
heads instead of failing it."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.speculation.medusa_device_cache import device_bytes
from loramux.model.loader import read_model_config
from polling import wait_until_async

PROMPTS = ["Tell me about the sea.", "Write a poem about snow.", "What is two plus two?", "Name three colours."]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def zero_heads(hidden: int, digest: str) -> MedusaHeadsWeights:
    """Heads that propose the model's next token again (residual of zero): they always propose."""
    zero = (torch.zeros(hidden, hidden), torch.zeros(hidden))
    return MedusaHeadsWeights(2, hidden, [zero, zero], digest=digest)


def speculating_engine(tiny_dir, tokenizer, **config):
    return make_engine(tiny_dir, tokenizer, speculative_tokens=2, speculative_methods="medusa",
                       speculative_max_batch=64, **config)


@pytest.fixture
def hidden(tiny_dir) -> int:
    return read_model_config(tiny_dir)[0].hidden_size


@pytest.fixture
def reference(tiny_dir, tokenizer) -> list[list[int]]:
    """Greedy outputs of PROMPTS without speculation."""
    outs = run_to_completion(make_engine(tiny_dir, tokenizer), [(p, PARAMS, None) for p in PROMPTS])
    return [o.token_ids for o in outs]


def run(engine, requests) -> dict[str, object]:
    """add_request(request_id, prompt, params, medusa=...) for each (request_id, prompt, medusa); step until done."""
    for request_id, prompt, medusa in requests:
        engine.add_request(request_id, prompt, PARAMS, **({"medusa": medusa} if medusa is not None else {}))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def medusa_proposed(out) -> int:
    return out.speculation.get("medusa", {}).get("proposed", 0)


def test_device_bytes_stay_within_the_budget_and_a_set_that_does_not_fit_runs_without(tiny_dir, tokenizer, hidden,
                                                                                        reference):
    one = device_bytes(zero_heads(hidden, "x"), torch.float32)
    assert one == 2 * (hidden * hidden + hidden) * 4
    engine = speculating_engine(tiny_dir, tokenizer, medusa_device_bytes=2 * one + one // 2)  # room for two sets
    cache = engine.medusa_device
    sets = [zero_heads(hidden, f"digest-{i}") for i in range(12)]

    # Two sets in use fill the budget: the third is not placed, and its request runs without heads, exactly.
    held = [engine.prepare_medusa(s) for s in sets[:3]]
    assert held[0] is not None and held[1] is not None and held[2] is None
    assert cache.stats()["bytes"] == 2 * one and cache.stats()["no_room"] == 1
    outs = run(engine, [("r0", PROMPTS[0], held[0]), ("r1", PROMPTS[1], held[1]), ("r2", PROMPTS[2], sets[2])])
    assert [outs[f"r{i}"].token_ids for i in range(3)] == reference[:3]
    assert medusa_proposed(outs["r0"]) > 0 and medusa_proposed(outs["r1"]) > 0
    assert medusa_proposed(outs["r2"]) == 0  # no heads of its own, and the engine has none for everyone
    assert cache.stats()["sets"] == 2 and cache.stats()["sets_in_use"] == 0

    # Any number of digests: unused sets are evicted least recently used first; bytes never pass the budget.
    pinned = engine.prepare_medusa(sets[1])  # digest-1 in use; digest-0 is the least recently used
    for i, weights in enumerate(sets[2:], start=2):
        heads = engine.prepare_medusa(weights)
        assert heads is not None, i
        assert cache.stats()["bytes"] <= cache.budget
        assert cache.cached(sets[1].digest) is pinned  # a set in use is never evicted
        engine.release_medusa(pinned)
        outs = run(engine, [(f"n{i}", PROMPTS[3], heads)])
        assert outs[f"n{i}"].token_ids == reference[3] and medusa_proposed(outs[f"n{i}"]) > 0
    assert cache.stats()["bytes"] == 2 * one and cache.stats()["builds"] == 2 + 10
    assert cache.cached(sets[0].digest) is None
    engine.release_medusa(pinned)
    assert engine.stats()["medusa_device"]["sets_in_use"] == 0


def test_a_released_set_stays_cached_and_is_not_rebuilt(tiny_dir, tokenizer, hidden, reference):
    engine = speculating_engine(tiny_dir, tokenizer)
    weights = zero_heads(hidden, "digest-a")
    first = engine.prepare_medusa(weights)
    outs = run(engine, [("a", PROMPTS[0], first), ("b", PROMPTS[1], engine.prepare_medusa(weights))])
    assert engine.medusa_device.stats()["builds"] == 1  # two requests, one copy
    assert engine.medusa_device.leases(weights.digest) == 0 and engine.medusa_device.stats()["sets"] == 1
    # A later request with the same digest finds the copy, as prepared heads or as weights (cached: no build).
    again = run(engine, [("c", PROMPTS[0], engine.prepare_medusa(weights)), ("d", PROMPTS[1], weights)])
    assert engine.medusa_device.stats()["builds"] == 1 and engine.medusa_device.cached(weights.digest) is first
    engine.release_medusa(first)
    for out in (*outs.values(), *again.values()):
        assert medusa_proposed(out) > 0
    assert [outs["a"].token_ids, outs["b"].token_ids, again["c"].token_ids, again["d"].token_ids] == \
        reference[:2] * 2


def test_the_copy_is_made_off_the_engine_thread_and_steps_go_on_meanwhile(tiny_dir, tokenizer, hidden, reference):
    """A request whose heads are still being copied does not hold up the engine: another request runs to
    its end meanwhile. The copy runs on the helper thread, never the engine's."""
    engine = speculating_engine(tiny_dir, tokenizer)
    started, gate, threads = threading.Event(), threading.Event(), []
    real_build = engine.medusa_device._build

    def slow_build(weights):
        threads.append(threading.current_thread().name)
        started.set()
        if threading.current_thread().name != "loramux-engine":  # (on the engine thread this would hang it)
            assert gate.wait(30)
        return real_build(weights)

    engine.medusa_device._build = slow_build
    async_engine = AsyncEngine(engine)

    async def collect(request_id, prompt, **kwargs):
        outs = [o async for o in async_engine.generate(EngineRequest(request_id, prompt, PARAMS, **kwargs))]
        return outs[-1]

    async def scenario():
        with_heads = asyncio.create_task(collect("heads", PROMPTS[0], medusa=zero_heads(hidden, "digest-slow")))
        assert await asyncio.to_thread(started.wait, 30)
        plain = await collect("plain", PROMPTS[1])  # finishes while the copy is still held at the gate
        gate.set()
        return plain, await with_heads

    try:
        plain, heads = asyncio.run(scenario())
    finally:
        gate.set()
        async_engine.shutdown()
    assert len(threads) == 1 and threads[0].startswith("loramux-medusa-device"), threads
    assert plain.token_ids == reference[1] and heads.token_ids == reference[0]
    assert medusa_proposed(heads) > 0 and engine.medusa_device.leases("digest-slow") == 0


def test_a_caller_that_leaves_during_the_copy_gives_the_set_back(tiny_dir, tokenizer, hidden):
    engine = speculating_engine(tiny_dir, tokenizer)
    started, gate = threading.Event(), threading.Event()
    real_build = engine.medusa_device._build

    def slow_build(weights):
        started.set()
        assert gate.wait(30)
        return real_build(weights)

    engine.medusa_device._build = slow_build
    async_engine = AsyncEngine(engine)

    async def scenario():
        task = asyncio.create_task(anext(async_engine.generate(
            EngineRequest("gone", PROMPTS[0], PARAMS, medusa=zero_heads(hidden, "digest-gone")))))
        assert await asyncio.to_thread(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await wait_until_async(lambda: engine.medusa_device.stats()["builds"] == 1
                               and engine.medusa_device.stats()["sets_in_use"] == 0,
                               "the copy made for a caller that left to be given back",
                               detail=engine.medusa_device.stats)

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        async_engine.shutdown()
    stats = engine.medusa_device.stats()
    assert stats["builds"] == 1 and stats["sets"] == 1 and stats["sets_in_use"] == 0
    assert not engine.has_unfinished()


def test_a_copy_that_fails_runs_the_request_without_heads(tiny_dir, tokenizer, hidden, reference):
    engine = speculating_engine(tiny_dir, tokenizer)

    def out_of_memory(weights):
        raise OOM("CUDA out of memory. Tried to allocate 2.00 GiB")

    real_build, engine.medusa_device._build = engine.medusa_device._build, out_of_memory
    async_engine = AsyncEngine(engine)

    async def collect(request_id, prompt, **kwargs):
        return [o async for o in async_engine.generate(EngineRequest(request_id, prompt, PARAMS, **kwargs))][-1]

    try:
        failed = asyncio.run(collect("oom", PROMPTS[0], medusa=zero_heads(hidden, "digest-oom")))
        stats = engine.medusa_device.stats()
        engine.medusa_device._build = real_build  # a failure is not remembered: the next request gets them
        placed = asyncio.run(collect("ok", PROMPTS[0], medusa=zero_heads(hidden, "digest-oom")))
    finally:
        async_engine.shutdown()
    assert failed.token_ids == reference[0] and failed.finish_reason == "length" and medusa_proposed(failed) == 0
    assert (stats["build_failures"], stats["bytes"], stats["sets"]) == (1, 0, 0)
    assert placed.token_ids == reference[0] and medusa_proposed(placed) > 0
