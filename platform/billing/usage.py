"""What one finished request hands to the ledger: who, what was served, tokens, timings, outcome."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime

from loramux.db.models import utcnow

# Outcomes a finished request can have (the engine's finish reasons, plus "error").
OUTCOMES = ("stop", "length", "timeout", "cancelled", "error")


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    tenant_id: str
    key_id: str
    tier: str
    model: str  # the base model id
    adapter_id: str | None  # what was served (after any fallback); None = the base model
    adapter_version: int | None
    adapter_digest: str | None
    requested: str  # the model / adapter reference the client asked for
    fallback: bool  # served something other than what was requested
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float
    created_at: datetime = field(default_factory=utcnow)
    end_user: str | None = None  # the client's own id of its end user (OpenAI's `user`), at most 256 characters
    replica: str | None = None  # the engine replica that served it (scale-out); None in a single process
    part: int = 0  # which part of its request this row bills: a fan-out's adapter index, else 0
    # A request that combined adapters with weights: [{"adapter_id", "version", "digest", "weight"}, ...].
    composition: list[dict] | None = None
    tags: list[str] | None = None  # the request's labels (`X-Loramux-Tags` / `metadata.tags`)

    def as_dict(self) -> dict:
        return asdict(self)
