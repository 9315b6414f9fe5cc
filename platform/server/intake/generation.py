"""`Intake`: a route's generation request as `RequestPipeline.start_generation` takes it, with the route's
defaults (`RouteDefaults`). The route has parsed the body and built the prompt; nothing is tokenized yet."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.sampling.params import StructuredOutput
from loramux.server.intake.params import GenerationParams
from loramux.server.intake.prompts import Prompt


@dataclass(frozen=True)
class RouteDefaults:
    """What a route sets when the request does not: its request ids' prefix (`<id_prefix>-<hex>`), max_tokens
    (within the room the prompt leaves in the context) and temperature."""

    id_prefix: str
    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class Intake:
    """One generation request from a route.

    - `model`: the adapter reference the request names (OpenAI's `model`, the native `adapter_id`); None or
      the base model's name for the base model.
    - `body`: the shared sampling and stopping fields, `timeout_s`, `user`, `adapters` (a weighted composition).
    - `arrival`: time.monotonic() when the route got the request.
    - `max_tokens`: as asked; None for the route's default.
    - `n`: choices. `models`: a fan-out, one choice per adapter named (then `n` is 1).
    - `sampling`: more `SamplingParams` fields the route decides (`structured`, `top_logprobs`).
    - `logprobs_per_token`: logprob entries one answer holds per generated token (top_logprobs + 1 when
      logprobs are asked for and not streamed, else 0), bounded by `check_logprob_volume`.
    - `tags`: the request's labels (`X-Loramux-Tags` and `metadata.tags`, see `request_tags`).
    - `constraints`: (structured-output constraint, what it is called in messages) pairs to compile before
      the request is queued: the one `sampling` sets, or one compiled only to check it.
    """

    model: str | None
    prompt: Prompt
    body: GenerationParams
    arrival: float
    defaults: RouteDefaults
    max_tokens: int | None = None
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs_per_token: int = 0
    constraints: Sequence[tuple[StructuredOutput | None, str | None]] = ()
    models: Sequence[str] | None = None
    tags: Sequence[str] = ()  # the request's labels (`request_tags`), on its ledger rows
