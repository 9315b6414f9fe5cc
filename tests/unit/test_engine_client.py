"""One engine interface: AsyncEngine (in process) and RemoteEngine (Ray Serve replicas) both provide every
member of `EngineClient` with its signature, and the HTTP layer asks `Services.engine` for nothing else."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from loramux.cluster.remote_engine import RemoteEngine
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.client import EngineClient

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(name for name in vars(EngineClient) if not name.startswith("_"))


def _shape(function) -> tuple:
    """What callers rely on: each parameter's name, kind and default, and sync / coroutine / async generator
    (a Protocol method returning an AsyncIterator stands for an async generator)."""
    signature = inspect.signature(function)
    if inspect.isasyncgenfunction(function) or str(signature.return_annotation).startswith("AsyncIterator"):
        flavour = "async generator"
    else:
        flavour = "coroutine" if inspect.iscoroutinefunction(function) else "sync"
    return flavour, [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def mismatches(cls, instance) -> list[str]:
    """How `cls` (and its `instance`, for attributes set in __init__) differs from EngineClient."""
    found = []
    for name in MEMBERS:
        wanted = inspect.getattr_static(EngineClient, name)
        given = inspect.getattr_static(cls, name, None)
        if isinstance(wanted, property):
            if given is None and name not in vars(instance):
                found.append(f"{name}: missing")
            elif given is not None and callable(given):
                found.append(f"{name}: a method, not an attribute")
        elif given is None or not callable(given):
            found.append(f"{name}: missing")
        elif _shape(given) != _shape(wanted):
            found.append(f"{name}: {_shape(given)} != {_shape(wanted)}")
    return found


@pytest.fixture
def async_engine(tiny_engine):
    engine = AsyncEngine(tiny_engine)
    yield engine
    engine.shutdown()


def test_the_interface_names_what_the_server_uses():
    assert {"generate", "abort", "compile_structured", "evict_adapter", "adapter_residency", "stats",
            "estimated_queue_wait_s", "max_model_len", "tokenizer", "max_chars_per_token", "encode", "encode_chat",
            "token_texts", "connect", "shutdown"} == set(MEMBERS)
    for name in MEMBERS:
        assert inspect.getdoc(inspect.getattr_static(EngineClient, name)), f"EngineClient.{name} has no docstring"


def test_async_engine_is_an_engine_client(async_engine):
    assert mismatches(AsyncEngine, async_engine) == []
    assert isinstance(async_engine, EngineClient)


def test_remote_engine_is_an_engine_client(tokenizer):
    remote = RemoteEngine(handle=None, tokenizer=tokenizer, max_model_len=512, directory=None)
    assert mismatches(RemoteEngine, remote) == []
    assert isinstance(remote, EngineClient)


def test_the_check_above_can_fail():
    class Drifted(RemoteEngine):
        def abort(self, request_id: str, reason: str) -> None:  # a new required parameter
            pass

        def stats(self, verbose: bool = True) -> dict:  # a new optional one
            return {}

        async def estimated_queue_wait_s(self) -> float:  # sync became async
            return 0.0

        def token_texts(self, token_ids: list[int]) -> list[str]:  # a renamed parameter
            return []

    drifted = Drifted(handle=None, tokenizer=None, max_model_len=512, directory=None)
    found = mismatches(Drifted, drifted)
    assert [line.split(":")[0] for line in found] == ["abort", "estimated_queue_wait_s", "stats", "token_texts"]
    del drifted.tokenizer
    assert "tokenizer: missing" in mismatches(Drifted, drifted)


def test_the_http_layer_asks_the_engine_only_for_engine_client_members():
    used = set()
    for folder in ("platform/server", "platform/console", "admin"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            used |= set(re.findall(r"services\.engine\.(\w+)", path.read_text()))
    assert used and used <= set(MEMBERS), sorted(used - set(MEMBERS))


def test_async_engine_says_publicly_whether_its_loop_has_stopped(tiny_engine):
    """The Ray replica's health check asks it (it read the private `_stopped`)."""
    engine = AsyncEngine(tiny_engine)
    try:
        assert engine.stopped is False
    finally:
        engine.shutdown()
    assert engine.stopped is True
    readers = [path.relative_to(ROOT).as_posix() for folder in ("platform", "admin", "adapters")
               for path in sorted((ROOT / folder).rglob("*.py"))
               if path.name != "async_engine.py" and re.search(r"engine\._stopped\b", path.read_text())]
    assert readers == []


def test_remote_stats_sum_expert_tokens_per_layer_and_expert(tokenizer):
    """The ingress's /metrics reads summed stats: per-expert routing counts add up element-wise over replicas."""
    class Directory:
        def snapshots(self):
            return {"a": {"stats": {"steps": 2, "moe_expert_tokens": [[1, 0, 3], []]}},
                    "b": {"stats": {"steps": 5, "moe_expert_tokens": [[2, 4, 0], []]}}}

    remote = RemoteEngine(handle=None, tokenizer=tokenizer, max_model_len=512, directory=Directory())
    stats = remote.stats()
    assert stats["steps"] == 7 and stats["moe_expert_tokens"] == [[3, 4, 3], []]
