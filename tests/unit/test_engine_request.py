"""EngineRequest's wire codec (what a Ray ingress sends a replica): every field crosses and comes back equal, local
fields stay behind, the clock field crosses as an age, and a wire dict from a different sender is handled as the
module docstring says (a missing field takes its default; an unknown one, or a missing required one, is refused)."""
from __future__ import annotations

import asyncio
import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from loramux.engine.request import EngineRequest, WireError
from loramux.engine.sampling.params import SamplingParams, StructuredOutput

# A non-default value for every field of SamplingParams and of EngineRequest: a field added to either without a
# value here fails `test_the_tables_cover_every_field`, so the round trip below covers it too.
PARAMS = {
    "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7, "max_tokens": 12, "min_tokens": 2,
    "stop": ["\n\n"], "stop_token_ids": [3], "ignore_eos": True, "timeout_s": 9.0, "speculative": False,
    "structured": StructuredOutput("json_schema", '{"type":"object"}'), "logit_bias": {5: -1.5}, "top_logprobs": 2,
}
SENDER_NOW, RECEIVER_NOW = 100.0, 5000.0
REQUEST = {
    "request_id": "chatcmpl-1.2", "prompt": [1, 2, 3], "params": SamplingParams(**PARAMS), "adapter": "tuned",
    "priority": 2, "tenant": "acme", "share_weight": 2.5, "cache_salt": "acme", "arrival": 90.5,
    "medusa": SimpleNamespace(digest="heads"),
}
LOCAL = {"adapter", "medusa"}  # objects of the sender's process: the receiver supplies its own
CLOCK = {"arrival"}  # a time.monotonic() instant: crosses as its age


def defaults(cls) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def plain(value) -> bool:
    """Only the types any process can rebuild without our classes."""
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


@pytest.mark.parametrize("cls, table", [(SamplingParams, PARAMS), (EngineRequest, REQUEST)])
def test_the_tables_cover_every_field(cls, table):
    assert {f.name for f in dataclasses.fields(cls)} == set(table)
    for name, default in defaults(cls).items():
        assert table[name] != default, f"{cls.__name__}.{name} is set to its default"


def test_every_field_survives_the_round_trip():
    request = EngineRequest(**REQUEST)
    wire = pickle.loads(pickle.dumps(request.to_wire(now=SENDER_NOW)))  # Ray pickles the payload
    assert plain(wire), wire
    assert set(wire) == {f.name for f in dataclasses.fields(EngineRequest)} - LOCAL
    local = {name: REQUEST[name] for name in LOCAL}  # what the receiver holds of its own
    back = EngineRequest.from_wire(wire, now=RECEIVER_NOW, **local)
    for f in dataclasses.fields(EngineRequest):
        sent, got = getattr(request, f.name), getattr(back, f.name)
        if f.name in CLOCK:
            assert wire[f.name] == SENDER_NOW - sent and got == RECEIVER_NOW - (SENDER_NOW - sent), f.name
        else:
            assert got == sent, f.name
    for f in dataclasses.fields(SamplingParams):
        assert getattr(back.params, f.name) == PARAMS[f.name], f.name
    assert isinstance(back.params, SamplingParams) and isinstance(back.params.structured, StructuredOutput)


def test_defaults_survive_too():
    request = EngineRequest("r", "Hello")
    assert EngineRequest.from_wire(request.to_wire()) == request


def test_a_field_missing_from_the_wire_takes_its_default():
    """A sender that does not know a field never set it: the receiver uses the default (a rolling upgrade)."""
    wire = EngineRequest("r", [1], tenant="acme", priority=3).to_wire()
    del wire["tenant"], wire["priority"]
    del wire["params"]["top_logprobs"]
    back = EngineRequest.from_wire(wire)
    assert (back.tenant, back.priority, back.params.top_logprobs) == ("", 0, 0)


@pytest.mark.parametrize("change, complaint", [
    (lambda w: w.update(deadline_s=3.0), "no field 'deadline_s'"),
    (lambda w: w["params"].update(typical_p=0.9), "no field 'typical_p'"),
    (lambda w: w.pop("request_id"), "needs 'request_id'"),
    (lambda w: w.update(adapter="tuned"), "no field 'adapter'"),  # local fields never come over the wire
])
def test_an_unknown_field_or_a_missing_required_one_is_refused(change, complaint):
    """A field this receiver does not know carries a meaning it would silently drop: refused, naming it."""
    wire = EngineRequest("r", [1]).to_wire()
    change(wire)
    with pytest.raises(WireError, match=complaint):
        EngineRequest.from_wire(wire)


def test_only_local_fields_are_supplied_by_the_receiver():
    with pytest.raises(TypeError, match="tenant"):
        EngineRequest.from_wire(EngineRequest("r", [1]).to_wire(), tenant="acme")


def test_the_remote_engine_sends_the_wire_form_and_the_adapter_version():
    """RemoteEngine.generate's payload: the request's wire form, the version beside it, routed by its digest."""
    from loramux.cluster.remote_engine import RemoteAdapter, RemoteEngine
    from loramux.engine.outputs import RequestError

    sent = {}

    class Call:
        def __init__(self, payload):
            sent["payload"] = payload

        async def __aiter__(self):
            yield {"error": "request", "message": "refused by the stub"}

        def cancel(self):
            pass

    class Handle:
        def options(self, stream, multiplexed_model_id):
            sent["model_id"] = multiplexed_model_id
            return SimpleNamespace(generate=SimpleNamespace(remote=Call))

    version = SimpleNamespace(digest="d-1", label="tuned@1")
    request = EngineRequest("r", [1, 2], SamplingParams(max_tokens=3), adapter=RemoteAdapter(version), tenant="a")

    async def run():
        with pytest.raises(RequestError, match="refused by the stub"):
            async for _ in RemoteEngine(Handle(), None, 64, None).generate(request):
                pass

    asyncio.run(run())
    payload = sent["payload"]
    assert set(payload) == {"request", "version"} and payload["version"] is version and sent["model_id"] == "d-1"
    back = EngineRequest.from_wire(payload["request"], adapter=request.adapter)
    assert back == request
