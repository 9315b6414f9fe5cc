"""Structured-output compiles are bounded: huge repetition bounds are refused
before anything compiles; a compile past its time limit is stopped (its worker process killed) before the
request is refused, so a flood of new pathological specs never stacks up running compiles; the engine
thread never compiles, not even for a spec the LRU evicted after the server checked it; on Ray the ingress
checks specs locally and the serving replica compiles as its `generate` starts.

The hostile shape (a flood of new pathological specs) is in tests/http/test_hostile_requests.py."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from conftest import live_stack, new_tenant_key
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams, StructuredOutput
from loramux.engine.structured.grammar import GrammarCache, StructuredOutputError

TIMEOUT_S = 1.0  # LORAMUX_STRUCTURED_COMPILE_TIMEOUT_S here; `.{0,n}` compiles for 5-8 s on the test vocabulary


def slow_regex(i: int) -> StructuredOutput:
    """A small regex xgrammar takes seconds to compile (`.` is every character), distinct per `i`."""
    return StructuredOutput("regex", f".{{0,{200 + i}}}")


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile-bounds")
    with live_stack(tmp, tiny_dir, tokenizer, structured_compile_timeout_s=TIMEOUT_S) as server:
        yield server, new_tenant_key(server.services, "acme", "premium")


def grammars_of(server) -> GrammarCache:
    return server.services.engine.engine.grammars


def compiles_still_running(grammars: GrammarCache) -> list:
    """Cache entries whose compile has not ended (an entry is done once its compile finished or was killed)."""
    with grammars._lock:
        return [key for key, entry in grammars._entries.items() if not entry.done()]


class ThreadsThatCompile:
    """Records the threads that ask the grammar cache for a compiled grammar."""

    def __init__(self, grammars: GrammarCache, monkeypatch):
        self.names: set[str] = set()
        for name in ("compile", "compile_future", "matcher", "_compile"):
            if hasattr(grammars, name):
                real = getattr(grammars, name)
                monkeypatch.setattr(grammars, name, self._recording(real))

    def _recording(self, real):
        def call(*args, **kwargs):
            self.names.add(threading.current_thread().name)
            return real(*args, **kwargs)
        return call


async def collect(stream) -> list:
    return [out async for out in stream]


# -- bounds before compiling, compiles that stop ------------------------------------------------------------
@pytest.mark.parametrize("spec,named", [
    (StructuredOutput("regex", "a{1,100000}"), "the repetition {1,100000} exceeds the limit of 4096"),
    (StructuredOutput("regex", "(ab){5000}"), "the repetition {5000} exceeds the limit of 4096"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 1_000_000})),
     "maxLength 1e+06 exceeds the limit of 4096"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "integer"}, "minItems": 5000}}})), "minItems 5000 exceeds the limit"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "^[a-z]{2,9999}$"})),
     "the pattern's repetition {2,9999} exceeds the limit"),
])
def test_huge_repetition_bounds_are_refused_before_compiling(tokenizer, spec, named):
    cache = GrammarCache(tokenizer, len(tokenizer), [2])
    cache.compiler = lambda: pytest.fail("compiled a spec that the bounds refuse")
    with pytest.raises(StructuredOutputError, match="LORAMUX_STRUCTURED_MAX_REPETITION") as caught:
        cache.compile(spec)
    assert named in str(caught.value)


def test_escaped_braces_are_no_repetition():
    from loramux.engine.structured.prechecks import check_spec

    check_spec(StructuredOutput("regex", r"x\{99999\}"), 4096)  # a literal brace, not a quantifier


def test_a_timed_out_compile_is_stopped_before_its_refusal_returns(stack):
    """Distinct slow specs at once (more than the compile workers): each is refused (400 too complex, or 503
    when no worker was free in time) only once its compile has stopped, so no compile outlives its request
    and the request's admission is held for all of it."""
    from loramux.server.http.errors import ApiError
    from loramux.server.intake.response_format import compile_structured

    server, _ = stack
    engine, grammars = server.services.engine, grammars_of(server)

    async def refused(i: int) -> ApiError:
        with pytest.raises(ApiError) as caught:
            await compile_structured(engine, slow_regex(i), TIMEOUT_S)
        assert not [k for k in compiles_still_running(grammars) if k == ("regex", slow_regex(i).spec)]
        return caught.value

    async def flood():
        return await asyncio.gather(*(refused(i) for i in range(4)))

    errors = asyncio.run(flood())
    assert {(e.status, e.code) for e in errors} <= {(400, "response_format_too_complex"), (503, "overloaded")}
    assert any(e.code == "response_format_too_complex" for e in errors)
    assert compiles_still_running(grammars) == []
    assert grammars.pool.stats()["compiles_running"] == 0
    assert len(grammars.pool.worker_pids()) <= grammars.pool.limits.workers
    engine.compile_structured(StructuredOutput("regex", "[a-c]{2}"))  # a fresh worker takes the next spec


# -- never on the engine thread; pinned until the request ends ----------------------------------------------
def test_the_engine_thread_never_compiles_even_for_a_spec_evicted_after_its_check(stack, monkeypatch):
    server, _ = stack
    async_engine, grammars = server.services.engine, grammars_of(server)
    monkeypatch.setattr(grammars, "max_entries", 1)
    threads = ThreadsThatCompile(grammars, monkeypatch)
    spec = StructuredOutput("choice", json.dumps(["north", "south"]))
    async_engine.compile_structured(spec)  # the server's check
    async_engine.compile_structured(StructuredOutput("choice", json.dumps(["other"])))  # evicts it
    assert len(grammars) == 1
    outs = asyncio.run(collect(async_engine.generate(EngineRequest("evicted", "Go", SamplingParams(
        structured=spec, max_tokens=8)))))
    assert outs[-1].finished and outs[-1].text in ("north", "south")
    assert "loramux-engine" not in threads.names, threads.names


def test_the_ray_ingress_checks_specs_locally_and_never_asks_a_replica_to_compile(tokenizer):
    from loramux.cluster.remote_engine import RemoteEngine

    class NoCalls:
        def __getattr__(self, name):
            pytest.fail(f"the ingress called the engine deployment's {name!r} to check a spec")

    remote = RemoteEngine(NoCalls(), tokenizer, 512, directory=None)
    remote.compile_structured(StructuredOutput("regex", "[a-z]{3}"))
    with pytest.raises(StructuredOutputError, match=r"the repetition \{1,100000\} exceeds the limit of 4096"):
        remote.compile_structured(StructuredOutput("regex", "a{1,100000}"))
    with pytest.raises(StructuredOutputError, match="unsupported keyword 'not'"):
        remote.compile_structured(StructuredOutput("json_schema", json.dumps({"not": {"type": "string"}})))


def test_a_replica_compiles_as_generate_starts_off_its_engine_thread(stack, monkeypatch):
    """The replica's generate (what the ingress streams from) compiles before the request enters the engine;
    a spec the compile refuses comes back as a request error (a 400 at the ingress)."""
    from loramux.cluster.replica import EngineReplica

    server, _ = stack
    replica = object.__new__(EngineReplica)  # its engine only: no Redis, no adapter cache levels
    replica.engine, replica.replica_id, replica._sent = server.services.engine, "r0", {}
    threads = ThreadsThatCompile(grammars_of(server), monkeypatch)

    def payload(request_id: str, spec: StructuredOutput) -> dict:
        request = EngineRequest(request_id, "Pick", SamplingParams(structured=spec, max_tokens=8))
        return {"request": request.to_wire(), "version": None}

    good = asyncio.run(collect(replica.generate(payload("r-good", StructuredOutput("regex", "(up|down)")), None)))
    assert good[-1]["output"]["finished"] and good[-1]["output"]["text"] in ("up", "down"), good[-1]
    bad = asyncio.run(collect(replica.generate(payload("r-bad", StructuredOutput("regex", "a(?=b)")), None)))
    assert bad == [{"error": "request", "message": bad[0]["message"]}] and "Lookahead" in bad[0]["message"]
    assert "loramux-engine" not in threads.names, threads.names
