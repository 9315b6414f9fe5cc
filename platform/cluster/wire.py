"""What crosses the wire between an engine replica and the ingress for one request's stream.

An engine's intermediate outputs carry `SoFar` views of the request's growing lists; pickling those would
copy every token so far on every step. So the replica sends each output's new tokens only (`to_wire`), and
the ingress rebuilds outputs with views of its own copy of the lists (`Reassembler`): what routes see is
the same `RequestOutput` a local engine gives.
"""
from __future__ import annotations

import dataclasses

from loramux.engine.outputs import RequestOutput, SoFar

_GROWING = ("token_ids", "logprobs", "top_logprobs")


def to_wire(out: RequestOutput, replica: str) -> dict:
    """The output as plain data; an intermediate output without its growing lists (the ingress rebuilds them)."""
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    fields["replica"] = replica
    if not out.finished:
        for name in _GROWING:
            fields[name] = None
    else:
        for name in _GROWING:
            fields[name] = list(fields[name])
    return {"replica": replica, "output": fields}


class Reassembler:
    """Rebuilds one request's outputs on the ingress side from `to_wire` messages."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.replica: str | None = None

    def feed(self, message: dict) -> RequestOutput:
        self.replica = message["replica"]
        fields = dict(message["output"])
        if fields["finished"]:
            return RequestOutput(**fields)
        self.token_ids += fields["new_token_ids"]
        self.logprobs += fields["new_logprobs"]
        self.top_logprobs += fields["new_top_logprobs"]
        fields["token_ids"] = SoFar(self.token_ids, len(self.token_ids))
        fields["logprobs"] = SoFar(self.logprobs, len(self.logprobs))
        fields["top_logprobs"] = SoFar(self.top_logprobs, len(self.top_logprobs))
        return RequestOutput(**fields)
