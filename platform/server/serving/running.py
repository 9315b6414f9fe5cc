"""A request the engine accepted, from its first outputs to its ledger record: one HTTP request, one or
more choices (OpenAI's `n`: sibling engine requests sharing the prompt; or a fan-out's parts, one per
adapter), one record when it ends (one per part for a fan-out)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from loramux.adapters.residency.cache_levels import Acquired
from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.billing.ledger import durable
from loramux.engine.async_engine import EngineDeadError
from loramux.engine.outputs import RequestOutput
from loramux.server.http.errors import ApiError
from loramux.server.serving.composition_choice import Composition
from loramux.server.serving.fanout import Part
from loramux.server.serving.spend import Spend
from loramux.tenancy.tenants import TenantContext

log = logging.getLogger(__name__)

BILLING_WAIT_S = 5.0  # longest an answer waits for its ledger row to be durable (a stuck disk)
# How a request with several choices ends: the first of these that one of its choices ended with.
_OUTCOME_ORDER = ("error", "cancelled", "timeout", "length", "stop")


# The outcome of a request its engine lost (not a ledger outcome: such a request leaves no row).
LOST = "lost"


def combined_outcome(reasons: list[str | None]) -> str:
    """The outcome of a request from its choices' finish reasons: the worst of them (an error, a cancel,
    a timeout, then `length`), else "stop"."""
    present = {r or "stop" for r in reasons}
    return next((o for o in _OUTCOME_ORDER if o in present), "stop")


@dataclass
class Running:
    """A request the engine accepted: iterate `outputs()` (one choice) or `choice_outputs()` once; it
    cleans up however it ends. Choice i is the engine request `choice_ids[i]`; `lasts[i]` is the latest
    output of choice i taken so far."""

    request_id: str
    tenant: TenantContext
    requested: str
    version: AdapterVersionInfo | None
    lease: Acquired | None
    fallback_reason: str | None
    prompt_tokens: int
    arrival: float
    choice_ids: list[str]
    _streams: list[AsyncIterator[RequestOutput]]
    _firsts: list[RequestOutput]
    _on_end: Callable[[Running, str], list[Future]]
    user: str | None = None  # the client's end-user id (OpenAI's `user`), for the ledger
    prompt_ids: list[int] = field(default_factory=list)  # for an echo of the prompt
    streamed: bool = False  # its outputs go to the client as they come (SSE), not in one final answer
    composition: Composition | None = None  # the adapters it combines (`adapters`); then version is None
    # A fan-out's parts: choice i is served by parts[i] (its own adapter, lease and ledger row); empty for a
    # plain request, whose choices all use `version` / `lease`.
    parts: list[Part] = field(default_factory=list)
    spend: Spend | None = None  # its budget reservation and, once it ended, its cost
    tags: list[str] = field(default_factory=list)  # its labels, for the ledger (tag budgets, spend reports)
    _ended: bool = field(default=False, init=False)
    _billing: list[Future] = field(default_factory=list, init=False)  # the ledger's durability futures
    inter_token_s: list[float] = field(default_factory=list, init=False)
    lasts: list[RequestOutput | None] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.lasts = list(self._firsts)

    @property
    def n(self) -> int:
        return len(self._streams)

    @property
    def replica(self) -> str | None:
        """The engine replica that served choice 0 (scale-out), None in a single process."""
        last = self.lasts[0] if self.lasts else None
        return last.replica if last is not None else None

    @property
    def billed_prompt_tokens(self) -> int:
        """Prompt tokens billed: the prompt once (`n` choices share its KV blocks), or once per part of a
        fan-out (each adapter computes it)."""
        return self.prompt_tokens * max(1, len(self.parts))

    @property
    def cached_tokens(self) -> int:
        """Billed prompt tokens found in the prefix cache: choice 0's (it computed the shared prompt), or the
        sum over a fan-out's parts."""
        if not self.parts:
            return self.lasts[0].num_cached_tokens if self.lasts and self.lasts[0] is not None else 0
        return sum(o.num_cached_tokens for o in self.lasts if o is not None)

    def leases(self) -> list[Acquired]:
        """Every host-RAM lease the request holds (its adapter's, or each part's), to give back once."""
        held = [self.lease] + [p.lease for p in self.parts]
        return [lease for lease in held if lease is not None]

    def choice_fields(self, index: int) -> dict:
        """Extra fields of choice `index` in answers and chunks: a fan-out part's `model` (as the client
        named it); none for a plain request."""
        return {"model": self.parts[index].requested} if self.parts else {}

    @property
    def adapter_level(self) -> str | None:
        """Where the adapter came from into host RAM for this request: "ram", "disk" or "store"."""
        return self.lease.level if self.lease else None

    def extension(self, out: RequestOutput | None = None) -> dict:
        """The `loramux` extension field of responses (timings of `out`, choice 0's final output)."""
        timings = out.timings if out is not None else {}
        ext = {"request_id": self.request_id, "queue_ms": timings.get("queue_ms"), "ttft_ms": timings.get("ttft_ms"),
               "tokens_per_s": timings.get("decode_tokens_per_s"), "total_ms": timings.get("total_ms"),
               "adapter": None, "tier": self.tenant.tier.name}
        if self.version is not None:
            ext["adapter"] = {"id": self.version.adapter_id, "name": self.version.name,
                              "version": self.version.version, "cache_tier": self.adapter_level}
        if self.composition is not None:
            ext["composition"] = self.composition.extension()
        if self.fallback_reason is not None:
            ext["fallback"] = {"requested": self.requested, "reason": self.fallback_reason}
        if out is not None and out.speculation:  # draft tokens proposed / accepted per method (choice 0)
            ext["speculation"] = out.speculation
        if self.n > 1:  # how much of the shared prompt each choice found in the prefix cache
            ext["choice_cached_tokens"] = [o.num_cached_tokens if o is not None else 0 for o in self.lasts]
        if self.parts:
            ext["fanout"] = [_part_extension(p) for p in self.parts]
        if self.spend is not None:
            ext.update(self.spend.extension())
        return ext

    def headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self.request_id}
        if self.version is not None:
            headers["X-Loramux-Adapter-Version"] = f"{self.version.adapter_id}@{self.version.version}"
            headers["X-Loramux-Adapter-Tier"] = self.adapter_level or ""
        if self.fallback_reason is not None:
            headers["X-Loramux-Fallback"] = "base" if self.version is None else self.version.name
        if self.spend is not None:
            headers.update(self.spend.headers())
        return headers

    def _took(self, index: int, out: RequestOutput, previous: list[float | None]) -> None:
        self.lasts[index] = out
        if out.new_token_ids:
            now = time.monotonic()
            if previous[index] is not None:
                self.inter_token_s.append(now - previous[index])
            previous[index] = now

    async def choice_outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) pairs of every choice as they come; leaving early (client gone) cancels
        every choice in the engine. When the last one has been taken, the loop ends only once the request's
        ledger row is durable, so whatever the caller sends next (the final chunk, the usage, the JSON
        answer) is never sent for an unbilled request."""
        outcome = "error"
        previous = [time.monotonic() if f.new_token_ids else None for f in self._firsts]
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, first in enumerate(self._firsts):
                yield i, first
            if self.n == 1:  # the common case, without a task per output
                while not self.lasts[0].finished:
                    out = await anext(self._streams[0])
                    self._took(0, out, previous)
                    yield 0, out
            else:
                pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self._streams)
                           if not self.lasts[i].finished}
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for future in sorted(done, key=pending.__getitem__):
                        i = pending.pop(future)
                        out = future.result()
                        self._took(i, out, previous)
                        yield i, out
                        if not out.finished:
                            pending[asyncio.ensure_future(anext(self._streams[i]))] = i
            outcome = combined_outcome([o.finish_reason for o in self.lasts])
        except EngineDeadError:
            # The engine (on a cluster: the replica) stopped under the request: the client gets a retriable
            # error and will send it again, so an attempt that sent the client nothing is not billed (see
            # RequestPipeline._finished); tokens already streamed to the client are billed, as an error.
            sent = self.streamed and any(o is not None and o.token_ids for o in self.lasts)
            outcome = "error" if sent else LOST
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            for future in pending:  # a choice still waiting for output: its stream is closed below
                future.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for stream in self._streams:
                await stream.aclose()  # aborts an engine request that had not finished
            self.end(outcome)
        await self._billed()  # only after a normal end: nobody is waiting for a cancelled request's answer

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs of a one-choice request (see `choice_outputs`)."""
        if self.n != 1:
            raise RuntimeError("outputs() is for one choice; iterate choice_outputs()")
        choices = self.choice_outputs()
        try:
            async for _, out in choices:
                yield out
        finally:
            await choices.aclose()

    async def _billed(self) -> None:
        """Wait until the ledger holds this request durably (its write-ahead log line is fsync'd), or fail
        the request: an answer is never sent for a request without its ledger row. A record the ledger
        refused (invalid data) or could not store (the log cannot be written) raises ApiError 500
        `billing_failed`, so the client gets a server error instead of free inference. A slow disk delays
        the answer at most BILLING_WAIT_S; then it goes out, logged: the record is queued in memory and is
        written once the disk recovers (unless the process dies first)."""
        for future in self._billing:
            try:
                stored = await durable(future, BILLING_WAIT_S)
            except asyncio.TimeoutError:
                log.error("request %s: its ledger row is not durable after %.0f s (slow disk); answering, the "
                          "record stays queued", self.request_id, BILLING_WAIT_S)
                continue
            except Exception:  # noqa: BLE001 - the log could not be written: this request is not billed
                log.exception("request %s: its ledger record could not be stored; failing the request",
                              self.request_id)
                stored = False
            if not stored:
                log.error("request %s: answered with 500 because its ledger record was refused", self.request_id)
                raise ApiError(500, f"the server could not record this request for billing; it was not charged. "
                                    f"Retry it; request id {self.request_id}", code="billing_failed")

    async def finals(self) -> list[RequestOutput]:
        """Run every choice to its end; their final outputs, by index."""
        async for _ in self.choice_outputs():
            pass
        return list(self.lasts)

    async def final(self) -> RequestOutput:
        return (await self.finals())[0]

    def abandon(self, index: int, final: RequestOutput) -> None:
        """The engine aborted choice `index` because its reader stalled (a client that stopped reading):
        give back what the request holds and bill what was generated now, even if the stuck reader never
        returns. (The server aborts the other choices, which share that reader.)"""
        self.lasts[index] = final
        self.end("cancelled")

    def end(self, outcome: str) -> None:
        if not self._ended:
            self._ended = True
            self._billing = self._on_end(self, outcome)

    async def close(self) -> None:
        """Safety net for a request whose outputs were never (fully) consumed, e.g. a client gone before
        the first chunk: cancel it in the engine and give back what it holds. A no-op once it ended."""
        if not self._ended:
            for stream in self._streams:
                await stream.aclose()  # aborts the engine request if it is still running
            self.end("cancelled")


def _part_extension(part: Part) -> dict:
    """A fan-out part in the `loramux` extension: what was asked for, what served it, and any fallback."""
    ext: dict = {"model": part.requested, "adapter": None}
    if part.version is not None:
        ext["adapter"] = {"id": part.version.adapter_id, "name": part.version.name, "version": part.version.version,
                          "cache_tier": part.lease.level if part.lease else None}
    if part.fallback_reason is not None:
        ext["fallback"] = {"requested": part.requested, "reason": part.fallback_reason}
    return ext
