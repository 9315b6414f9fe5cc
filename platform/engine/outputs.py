"""What the engine takes and gives: its configuration, each step's output per request, and the error
raised for a request it cannot take. `loramux.engine.engine` re-exports all three."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineConfig", "RequestOutput", "RequestError"]

_LATEST = ("text", "token_ids", "logprobs", "finished", "finish_reason", "timings", "num_cached_tokens")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    max_loras: int = 8  # device adapter slots; 0 disables LoRA
    max_lora_rank: int = 32
    lora_impl: str = "auto"  # LoRA kernels: auto (Triton on CUDA, torch on CPU), triton or torch
    priority_aging_s: float = 10.0  # waiting this long is worth one priority level
    enable_prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (per adapter version)
    num_speculative_tokens: int = 0  # prompt-lookup draft length; 0 = no speculation
    speculative_max_batch: int = 4  # speculate only while at most this many sequences decode


@dataclass
class RequestOutput:
    """What one step produced for one request: the new text and tokens, and the state so far."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    timings: dict[str, Any] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    adapter: str | None = None  # adapter name as requested

    def absorb(self, later: RequestOutput) -> RequestOutput:
        """Fold in a later output of the same request from the same step (a speculative step appends
        several tokens): the deltas add up, the state so far is the later one's. Returns self."""
        self.delta_text += later.delta_text
        self.new_token_ids += later.new_token_ids
        for name in _LATEST:
            setattr(self, name, getattr(later, name))
        return self


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, duplicate id, ...); the message says why."""
