"""The `EngineClient` interface (`loramux.engine.client`), served by engine replicas behind a Ray Serve
deployment handle.

The ingress's routes, limits and ledger run unchanged on top of it (see `loramux.server.serving.pipeline`): what
differs is where tokens come from. Tokenizing happens here, with the model's own tokenizer (no weights are
loaded on the ingress); generation is a streaming call to a replica chosen by Ray Serve's model
multiplexing, keyed by the adapter version's digest; engine-wide state (stats, residency, queue wait) comes
from the snapshots each replica publishes (`loramux.cluster.shared_state`).

A replica that dies mid-stream ends the request with `EngineDeadError` (HTTP 503, retriable); a refusal by
the engine (`RequestError`) arrives as such. Leaving the stream early cancels the call on the replica, which
aborts the request there.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.cluster.shared_state import ReplicaDirectory
from loramux.cluster.wire import Reassembler
from loramux.engine.async_engine import EngineDeadError
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import StructuredOutput
from loramux.engine.structured.compile_pool import CompileLimits
from loramux.engine.structured.prechecks import check_spec
from loramux.engine.tokens import TokenizerMethods

log = logging.getLogger(__name__)

# Engine stats that describe a replica's configuration rather than count its work: shown as the first replica's.
_PER_REPLICA = frozenset({"kv_block_size", "prefix_caching"})


@dataclass(frozen=True)
class RemoteAdapter:
    """What the ingress holds of an adapter: its registry version; the weights live on the replicas."""

    version: AdapterVersionInfo

    @property
    def digest(self) -> str:
        return self.version.digest

    @property
    def name(self) -> str:
        return self.version.label


class RemoteEngine(TokenizerMethods):
    """The `EngineClient` of engine replicas behind a Ray Serve deployment handle."""

    def __init__(self, handle, tokenizer, max_model_len: int, directory: ReplicaDirectory,
                 max_repetition: int = CompileLimits.max_repetition):
        """`handle`: the engine deployment's DeploymentHandle; `tokenizer`: the model's HF tokenizer;
        `max_repetition`: LORAMUX_STRUCTURED_MAX_REPETITION, checked here before a request is sent."""
        self.handle = handle
        self.max_repetition = max_repetition
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.directory = directory
        self._calls: dict[str, object] = {}  # request id -> its streaming call, for abort

    async def connect(self) -> None:
        """Learn the replicas' context length (called once at the ingress's start)."""
        info = await self.handle.info.remote()
        self.max_model_len = info["max_model_len"]

    # -- generation ------------------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, on_abandoned: Callable[[RequestOutput], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate, on a replica. Each output's `replica` names the replica that made it.
        The payload is the request's wire form (`EngineRequest.to_wire`: its local fields, the adapter and
        Medusa heads, stay here) and the adapter's `version` (None: the base model), which the replica loads
        by digest, the key Serve routes the call by. Medusa heads are not sent: the replicas load none yet."""
        adapter = request.adapter
        if adapter is not None and not isinstance(adapter, RemoteAdapter):
            raise TypeError(f"a RemoteEngine request's adapter is a RemoteAdapter, not {type(adapter).__name__}")
        payload = {"request": request.to_wire(), "version": adapter.version if adapter is not None else None}
        call = self.handle.options(stream=True, multiplexed_model_id=adapter.digest if adapter else "")
        stream = call.generate.remote(payload)
        request_id = request.request_id
        self._calls[request_id] = stream
        rebuild, finished = Reassembler(), False
        try:
            async for message in _guarded(stream):
                if "error" in message:
                    kind, text = message["error"], message["message"]
                    raise RequestError(text) if kind == "request" else EngineDeadError(text)
                out = rebuild.feed(message)
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._calls.pop(request_id, None)
            if not finished:
                stream.cancel()  # the replica's generator is cancelled, which aborts the request there

    def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()

    def compile_structured(self, spec: StructuredOutput) -> None:
        """Check `spec` here, without compiling it (size, unsupported keywords, repetition bounds): raise
        StructuredOutputError. The replica that serves the request compiles it, off its engine thread and
        within its compile limits, as its `generate` starts; a spec it refuses or stops comes back as a
        RequestError (HTTP 400). Asking some other replica to compile would stall on it without a bound
        and help no one: that replica's cache is not the serving one's."""
        check_spec(spec, self.max_repetition)

    # -- engine-wide state, from the replicas' snapshots --------------------------------------------------
    def stats(self) -> dict:
        """Counters summed over the live replicas, plus `replicas`: each one's own snapshot."""
        snapshots = self.directory.snapshots()
        total: dict = {}
        for snap in snapshots.values():
            for key, value in snap.get("stats", {}).items():
                if key in _PER_REPLICA:  # the same on every replica: no sum
                    total.setdefault(key, value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                elif key == "moe_expert_tokens":  # per layer, per expert: summed element-wise
                    total[key] = _sum_nested(total.get(key), value)
        return {**total, "replicas": snapshots}

    def adapter_residency(self, digest: str) -> str | None:
        """"device" if a live replica holds the version on its device, else "loading" or None."""
        states = {snap.get("residency", {}).get(digest) for snap in self.directory.snapshots().values()}
        return "device" if "device" in states else "loading" if "loading" in states else None

    def estimated_queue_wait_s(self) -> float:
        """The shortest wait any live replica predicts (Ray routes to less loaded replicas first)."""
        waits = [snap.get("queue_wait_s", 0.0) for snap in self.directory.snapshots().values()]
        return min(waits, default=0.0)

    def evict_adapter(self, digest: str) -> None:
        """A version was deleted: every replica drops its copies (see ReplicaDirectory.broadcast_eviction)."""
        self.directory.broadcast_eviction(digest)

    def shutdown(self) -> None:
        """Cancel the calls in flight (each aborts its request on its replica); the replicas live on."""
        for call in list(self._calls.values()):
            call.cancel()


async def _guarded(stream) -> AsyncIterator[dict]:
    """The replica's messages; a replica lost mid-stream (its process died, its actor is gone) becomes an
    EngineDeadError, which clients get as a retriable 503."""
    from ray.exceptions import RayActorError, RayError

    try:
        async for message in stream:
            yield message
    except asyncio.CancelledError:
        raise
    except (RequestError, EngineDeadError):
        raise
    except RayActorError as exc:
        log.warning("engine replica lost mid-request: %s", type(exc).__name__)
        raise EngineDeadError("the engine replica serving this request stopped; retry the request") from None
    except RayError as exc:
        log.warning("engine call failed: %s", exc)
        raise EngineDeadError("the engine replica serving this request failed; retry the request") from None


def _sum_nested(total: list | None, counts: list) -> list:
    """Element-wise sum of two lists of per-layer lists of counts (None: nothing summed yet)."""
    if total is None:
        return [list(layer) for layer in counts]
    return [[a + b for a, b in zip(mine, theirs, strict=True)] for mine, theirs in zip(total, counts, strict=True)]
