"""The engine's configuration. A knob that Settings also has carries the Settings field's name, so
`EngineConfig.from_settings` takes it by name (LORAMUX_<FIELD>) and no list maps one onto the other."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loramux.settings import Settings

__all__ = ["EngineConfig"]


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token cap of one step
    # Time target of a step that carries prefill work while streams decode (see loramux.engine.scheduling.step_budget):
    # 0 = auto (twice the decodes' own cost), None = no time target, the token cap alone (tests that count).
    step_target_ms: float | None = 0.0
    max_model_len: int = 4096
    max_loras: int = 0  # most distinct adapters with running requests (one batch); 0 = no cap
    max_lora_rank: int = 128  # largest adapter rank served; 0 disables LoRA
    adapter_pool_bytes: int = 0  # device memory for adapters at their own ranks; 0 = as much as kv_cache_bytes
    adapter_min_residency_s: float = 2.0  # a loaded adapter stays at least this long (unless deleted)
    adapter_drain_after_s: float = 2.0  # a request blocked this long on a full pool reserves room (a drain)
    async_adapter_loads: bool = True  # host -> device copies on a helper thread (False: inline, for tests)
    lora_impl: str = "auto"  # LoRA kernels: auto (Triton on CUDA, torch on CPU), triton or torch
    cuda_graphs: bool = True  # plain decode steps replay CUDA graphs (CUDA only; loramux.engine.cuda_graphs)
    priority_aging_s: float = 10.0  # waiting this long is worth one priority level
    # Fair share within a priority level (loramux.engine.scheduling.fair_share): counter weight of a prompt / output
    # token.
    fair_share_input_weight: float = 1.0
    fair_share_output_weight: float = 2.0
    prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (per adapter version)
    # Prompt-lookup draft length; 0 = no speculation. Off unless asked for, so an engine built in code (a
    # test) decodes one token a step; Settings turns it on by default (LORAMUX_SPECULATIVE_TOKENS).
    speculative_tokens: int = 0
    speculative_max_batch: int = 4  # speculate only while at most this many sequences decode
    # Proposers, in the order that breaks ties (loramux.engine.speculation.speculator): those available are used,
    # each row
    # with the one expected to pay most; whether a step speculates at all is the cost model's decision.
    speculative_methods: str = "ngram,medusa,draft"
    # Speculate only while it pays, judged from measured acceptance and the fitted step cost model
    # (loramux.engine.speculation.policy). Off for an engine built in code, whose tests count drafts deterministically;
    # Settings turns it on (LORAMUX_SPECULATIVE_ADAPTIVE).
    speculative_adaptive: bool = False
    # Device memory for requests' own Medusa head sets (by digest, LRU over unused ones; loramux.engine.
    # medusa_device_cache): a set that does not fit beside those in use is not loaded and its request runs without.
    medusa_device_bytes: int = 512 * 1024**2

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The configuration `settings` asks for: every field that Settings also has takes its value from
        it; the others (`num_blocks`, `async_adapter_loads`) keep their defaults."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if f.name in type(settings).model_fields})
