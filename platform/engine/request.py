"""`EngineRequest`: one request as the engine takes it, from the serving pipeline down to `LLMEngine.add_request`,
and its wire form for a Ray replica (`to_wire` / `from_wire`). No torch here.

The same object passes every depth: `EngineClient.generate(request)` (`AsyncEngine`, or `RemoteEngine` on a
cluster), then the engine thread's `LLMEngine.add_request(request)`; on a cluster the ingress sends
`request.to_wire()` and the replica rebuilds it with `EngineRequest.from_wire`. A new field is added to the
dataclass, set by its producer and read by its consumer; the codec needs no edit (it walks `dataclasses.fields`).

The wire codec:
- Plain data only: nested dataclasses (`SamplingParams`, its `StructuredOutput`) become dicts of their fields and
  are rebuilt from the declared field types (a dataclass type, or a union of one with None); lists and dicts
  hold plain values.
- A field marked `local` never crosses: it is an object of this process (the adapter's host-RAM weights, Medusa
  heads); the receiver supplies its own (`from_wire(..., adapter=...)`).
- A field marked `clock` is a `time.monotonic()` instant, which means nothing on another machine: it crosses as
  its age (seconds before the sender's now) and becomes an instant of the receiver's clock again.
- A field missing from the wire takes its default (a sender that does not know a field did not set it); a
  missing field without a default, or a field the receiver does not know (a sender newer than the receiver,
  whose meaning would be silently dropped), is a `WireError`.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from loramux.engine.sampling.params import SamplingParams

if TYPE_CHECKING:  # they import torch
    from loramux.adapters.formats.medusa import MedusaHeadsWeights
    from loramux.engine.speculation.medusa_heads import MedusaHeads

__all__ = ["EngineRequest", "HeldAdapter", "WireError"]

_WIRE = "wire"  # field metadata key: how a field crosses the wire
_LOCAL, _CLOCK = "local", "clock"


class WireError(ValueError):
    """A wire dict that does not make the dataclass: an unknown field, or a required one missing."""


class HeldAdapter(Protocol):
    """An adapter the caller holds for the request: a LoRAAdapter in host RAM (in process, and on a replica),
    or on a Ray ingress a RemoteAdapter (its registry version; the weights live on the replicas)."""

    @property
    def name(self) -> str: ...

    @property
    def digest(self) -> str: ...


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: what to generate, for whom, with which adapter and speculators.

    - `request_id`: unique among the engine's running requests (a choice of `n` or a fan-out part is an engine
      request of its own: `<id>`, `<id>.1`, ...).
    - `prompt`: token ids, or text that the engine tokenizes (with the tokenizer's own special tokens).
    - `params`: sampling and stops; `params.timeout_s` is the deadline counted from `arrival`;
      `params.structured` the output constraint; `params.speculative` whether the request may speculate.
    - `adapter`: None for the base model, a registered adapter's name (LLMEngine only), or the adapter the caller
      holds until the request ends (`HeldAdapter`). Local: on Ray the ingress sends the adapter's registry version
      beside the request (it is the key Serve routes by) and the replica passes the LoRAAdapter it loaded.
    - `priority`: larger runs first (the tenant's tier). `tenant` and `share_weight` (its tier's weight): whose
      request, for the fair share between the tenants of one priority level.
    - `cache_salt`: namespaces its prefix-cache blocks (the tenant, when tenants must not share them).
    - `arrival` (time.monotonic()): when the request reached the server; queue time, TTFT and the deadline count
      from it (None: when the engine gets it). Crosses the wire as its age.
    - `medusa`: the Medusa heads of the request's adapter version (else the engine's own serve it): weights in
      host RAM (callers of `EngineClient.generate`), or heads that `LLMEngine.prepare_medusa` placed on the
      device (what AsyncEngine hands `add_request`). Local: replicas load no Medusa heads yet.

    What is not here stays a separate argument because it is of the caller's process and no part of what is
    asked: `generate`'s `on_abandoned` callback (runs on the caller's event loop) and `add_request`'s
    `grammar` (the compiled form of `params.structured`, made by AsyncEngine off the engine thread).
    """

    request_id: str
    prompt: str | list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | HeldAdapter | None = field(default=None, metadata={_WIRE: _LOCAL})
    priority: int = 0
    tenant: str = ""
    share_weight: float = 1.0
    cache_salt: str | None = None
    arrival: float | None = field(default=None, metadata={_WIRE: _CLOCK})
    medusa: MedusaHeadsWeights | MedusaHeads | None = field(default=None, metadata={_WIRE: _LOCAL})

    def to_wire(self, now: float | None = None) -> dict[str, Any]:
        """The request as plain data for another process (see the module docstring); `now`: this process's
        time.monotonic() (read when None)."""
        now = time.monotonic() if now is None else now
        wire: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            how, value = f.metadata.get(_WIRE), getattr(self, f.name)
            if how == _LOCAL:
                continue
            if how == _CLOCK and value is not None:
                value = max(0.0, now - value)
            wire[f.name] = _to_plain(value)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any], now: float | None = None, **local: Any) -> EngineRequest:
        """The request `to_wire` gave, with this process's `local` fields (e.g. `adapter`); `now`: this
        process's time.monotonic() (read when None). WireError for an unknown field or a required one missing."""
        now = time.monotonic() if now is None else now
        wrong = [name for name in local if _wire_of(cls).get(name, "") != _LOCAL]
        if wrong:
            raise TypeError(f"not a local field of {cls.__name__}: {', '.join(sorted(wrong))}")
        values = _fields_from_plain(cls, wire)
        for name, how in _wire_of(cls).items():
            if how == _CLOCK and values.get(name) is not None:
                values[name] = now - values[name]
        return cls(**values, **local)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _fields_from_plain(cls: type, wire: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `cls` from its plain form: nested dataclasses rebuilt, local fields left out."""
    crossing = {name for name, how in _wire_of(cls).items() if how != _LOCAL}
    unknown = sorted(set(wire) - crossing)
    if unknown:
        raise WireError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))} (a sender newer than this "
                        "receiver?)")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.name in crossing and f.name not in wire
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise WireError(f"{cls.__name__} needs {', '.join(map(repr, missing))}")
    return {name: _from_plain(_field_type(cls, name), value) for name, value in wire.items()}


def _from_plain(declared: Any, value: Any) -> Any:
    if isinstance(value, dict):
        args = typing.get_args(declared) if isinstance(declared, types.UnionType) or \
            typing.get_origin(declared) is typing.Union else (declared,)
        for candidate in args:
            if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
                return candidate(**_fields_from_plain(candidate, value))
    return value


@functools.cache
def _wire_of(cls: type) -> dict[str, str | None]:
    """Field name -> how it crosses (`_LOCAL`, `_CLOCK` or None: as plain data)."""
    return {f.name: f.metadata.get(_WIRE) for f in dataclasses.fields(cls)}


@functools.cache
def _field_type(cls: type, name: str) -> Any:
    """The declared type of field `name` (annotations are strings here: evaluated in the class's module)."""
    declared = next(f.type for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(declared, str):  # evaluated as typing.get_type_hints does
        declared = eval(declared, vars(sys.modules[cls.__module__]))
    return declared
