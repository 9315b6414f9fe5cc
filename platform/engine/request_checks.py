"""The checks a request passes before the engine queues it: a request that can never run is refused at once
with a RequestError whose message says why (fit for the user: the HTTP layer returns it as a 400)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.engine.outputs import RequestError
from loramux.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from loramux.adapters.residency.locations import AdapterResidency
    from loramux.engine.request import HeldAdapter
    from loramux.engine.scheduling.block_manager import BlockManager

__all__ = ["check_prompt", "check_servable", "resolve_adapter"]


def check_servable(adapter: LoRAAdapter, residency: AdapterResidency | None, max_lora_rank: int) -> LoRAAdapter:
    """`adapter`, if this engine can serve it: LoRA is on (`residency` is not None), its rank is within
    `max_lora_rank` and it fits the device pool (`AdapterResidency.check_servable`)."""
    if residency is None:
        raise RequestError("LoRA is disabled on this engine (max_lora_rank = 0)")
    if adapter.rank > max_lora_rank:
        raise RequestError(f"adapter {adapter.name!r} has rank {adapter.rank}; this server's maximum LoRA rank "
                           f"is {max_lora_rank} (LORAMUX_MAX_LORA_RANK)")
    try:
        residency.check_servable(adapter)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return adapter


def resolve_adapter(adapter: str | HeldAdapter | None, residency: AdapterResidency | None,
                    max_lora_rank: int) -> LoRAAdapter | None:
    """The adapter a request runs with: None for the base model, the object itself (checked as above) when
    the caller holds one, else the adapter registered under that name (RequestError when there is none)."""
    if isinstance(adapter, LoRAAdapter):
        return check_servable(adapter, residency, max_lora_rank)
    if adapter is None:
        return None
    if not isinstance(adapter, str):  # held, but not in this process's host RAM: nothing serves it here
        raise RequestError(f"unknown adapter {adapter!r}")
    lora = residency.lookup(adapter) if residency is not None else None
    if lora is None:
        raise RequestError(f"unknown adapter {adapter!r}")
    return lora


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager) -> None:
    """Refuse prompt token `ids` with `params` unless they can run: a non-empty prompt, every token id (of
    the prompt, stop tokens and logit_bias) in the vocabulary, room for at least one output token within
    `max_model_len`, and few enough KV blocks for the whole cache to hold it."""
    if not ids:
        raise RequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in ids) or any(t >= vocab_size for t in params.stop_token_ids):
        raise RequestError(f"token ids must be in [0, {vocab_size})")
    if bad := [t for t in params.logit_bias if t >= vocab_size]:
        raise RequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens; this model accepts at most "
                           f"{max_model_len - 1} prompt tokens")
    blocks = block_manager.blocks_for_tokens(len(ids) + 1)
    if blocks > block_manager.num_blocks:
        raise RequestError(f"the prompt needs {blocks} KV blocks but the cache has {block_manager.num_blocks}")
