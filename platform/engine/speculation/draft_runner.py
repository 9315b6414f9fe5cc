"""Draft-model speculation: a second, smaller resident model that proposes the target's next tokens.

`DraftRunner` owns the draft `LlamaModel`, its own paged KV cache (sized from a byte budget) and its own
`BlockManager` (prefix caching off). Per request it remembers the tokens whose KV it holds; each `propose`
keeps the longest common prefix of those with the request's current context (the tokens after it, rejected
drafts, are overwritten), computes only the new tokens, all requests' catch-up chunks in ONE batched forward,
then `k - 1` batched one-token decode forwards for every request together, and returns each request's greedy
continuation. A request that cannot get the blocks it needs gets [] and keeps nothing: the draft never raises
for lack of memory and never holds the target up.

`check_draft_compatible` refuses a draft whose tokenizer is not the target's (the target verifies draft token
ids as its own); `draft_from_settings` loads `LORAMUX_DRAFT_MODEL` into a runner.

The runner imports only the model, attention and block-manager modules: the engine wires it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.engine.scheduling.block_manager import BlockManager, OutOfBlocksError
from loramux.model.attention import AttentionMetadata, KVCache, PrefillChunk
from loramux.model.llama import LlamaModel

__all__ = ["DraftMismatchError", "DraftRunner", "check_draft_compatible", "draft_from_settings"]


@dataclass
class _DraftState:
    """What the draft holds for one request; BlockManager reads `block_table` and `num_computed_tokens` (and
    resets `block_hashes` / `num_released_blocks` on free), as on an engine Sequence."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is in the draft's cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_released_blocks: int = 0

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Blocks:
    """A bare block list handed to BlockManager.free (the trailing blocks a rollback no longer needs)."""

    block_table: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    num_released_blocks: int = 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftRunner:
    """The draft model with its own paged KV; see the module docstring.

    `kv_cache_bytes`: the budget for the draft's K and V over all its layers (at least one block);
    `max_model_len`: the longest context (plus drafts) it computes; proposals are cut to stay within it.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_model_len: int,
    ):
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        element = torch.empty((), dtype=dtype).element_size()
        block_bytes = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element
        num_blocks = kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"draft KV budget of {kv_cache_bytes} bytes holds no block: one block of {block_size} "
                f"tokens takes {block_bytes} bytes for this draft model"
            )
        self.kv = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.max_model_len = min(max_model_len, model.rope.cos.shape[0])
        self.states: dict[str, _DraftState] = {}

    @property
    def kv_bytes(self) -> int:
        """Bytes the draft's KV cache holds (K and V of every layer)."""
        return self.kv.k.numel() * self.kv.k.element_size() + self.kv.v.numel() * self.kv.v.element_size()

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def release(self, request_id: str) -> None:
        """Free the draft KV of `request_id` (finished or aborted); unknown ids are ignored."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state)

    def release_all(self) -> None:
        for request_id in list(self.states):
            self.release(request_id)

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, request_id: str, context: list[int], k: int) -> tuple[_DraftState, int] | None:
        """Roll the request's state back to its common prefix with `context` and give it blocks for the rest of
        the context and `k - 1` drafts fed back: (state, tokens kept), or None (and nothing held) when the
        blocks are not there."""
        bm = self.block_manager
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = _DraftState()
        # At least the last context token is computed again: its logits give the first draft.
        keep = min(_common_prefix(state.token_ids, context), len(context) - 1)
        del state.token_ids[keep:]
        needed = bm.blocks_for_tokens(len(context) + k - 1)
        if len(state.block_table) > needed:  # a rollback: the blocks past what this proposal fills go back
            bm.free(_Blocks(state.block_table[needed:]))
            del state.block_table[needed:]
        try:
            bm.allocate(state, len(context) + k - 1 - keep)  # all or nothing
        except OutOfBlocksError:
            self.release(request_id)  # what it held goes to the requests that fit
            return None
        return state, keep

    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """For each (request id, full context token ids, k): the draft's greedy continuation of up to `k` tokens
        ([] when k < 1, the context is empty or at max_model_len, or the draft lacks KV blocks for it)."""
        out: dict[str, list[int]] = {}
        active: list[tuple[str, _DraftState, list[int], int]] = []
        for request_id, context, k in requests:
            out[request_id] = []
            k = min(k, self.max_model_len - len(context))
            if k < 1 or not context:
                continue
            prepared = self._prepare(request_id, list(context), k)
            if prepared is None:
                continue
            active.append((request_id, prepared[0], list(context), k))
        if not active:
            return out

        # One forward for every request's catch-up chunk (prefill-chunk metadata, as the ModelRunner builds it).
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        last_rows: list[int] = []
        for _, state, context, _ in active:
            start, end = state.num_computed_tokens, len(context)
            row0 = len(tokens)
            tokens.extend(context[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(state.block_table, start, end))
            rope_len = end if start == 0 else None  # a whole prompt: LongRoPE picks its factors by its length
            chunks.append(PrefillChunk(row0, len(tokens), end, self._tensor(state.block_table), rope_len=rope_len))
            last_rows.append(len(tokens) - 1)
            state.token_ids[:] = context
        meta = AttentionMetadata(self._tensor(slots), chunks, len(tokens))
        hidden = self.model(self._tensor(tokens), self._tensor(positions), self.kv, meta)
        next_ids = self._greedy(hidden[self._tensor(last_rows)])
        drafts = {request_id: [t] for (request_id, *_), t in zip(active, next_ids)}

        # k - 1 one-token decode steps for the requests that want more, all together.
        for step in range(1, max(k for *_, k in active)):
            rows = [(rid, state) for rid, state, _, k in active if k > step]
            tokens, positions, slots, tables, lens = [], [], [], [], []
            for rid, state in rows:
                p = state.num_computed_tokens
                token = drafts[rid][-1]
                tokens.append(token)
                positions.append(p)
                slots.extend(self._slots(state.block_table, p, p + 1))
                tables.append(state.block_table[: self.block_manager.blocks_for_tokens(p + 1)])
                lens.append(p + 1)
                state.token_ids.append(token)
            table_tensor, mask = self._padded_tables_and_mask(tables, lens)
            meta = AttentionMetadata(
                self._tensor(slots), [], 0, table_tensor, mask, decode_context_lens=self._tensor(lens)
            )
            hidden = self.model(self._tensor(tokens), self._tensor(positions), self.kv, meta)
            for (rid, _), t in zip(rows, self._greedy(hidden)):
                drafts[rid].append(t)
        out.update(drafts)
        return out

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()

    def _padded_tables_and_mask(self, tables: list[list[int]], context_lens: list[int]):
        bs = self.block_size
        max_blocks = max(len(t) for t in tables)
        padded = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        valid = torch.arange(max_blocks * bs, device=self.device)[None, :] < self._tensor(context_lens)[:, None]
        mask = torch.zeros(valid.shape, dtype=self.kv.k.dtype, device=self.device)
        return padded, mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]


# -- compatibility and loading -----------------------------------------------------------------------------
class DraftMismatchError(ValueError):
    """The draft model cannot propose tokens for this target: their vocabularies differ."""


SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")


def check_draft_compatible(target_tokenizer, draft_tokenizer, target_cfg, draft_cfg) -> None:
    """Raise DraftMismatchError for a hybrid draft model (its linear-attention state has no rollback), or naming the
    first difference between the target's and the draft's vocabulary: the models' vocab sizes, the tokenizers'
    sizes, the first token id whose string differs, or a special token (bos, eos, pad, unk) that differs."""
    hint = "pick a draft model that uses the same tokenizer as the target model"
    if getattr(draft_cfg, "linear_attention", None) is not None:
        raise DraftMismatchError(f"the draft model is a hybrid ({draft_cfg.model_type}, linear-attention layers), "
                                 "whose per-sequence state a draft cannot roll back after a rejected token: pick a "
                                 "draft model with attention layers only")
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise DraftMismatchError(
            f"draft model's vocab_size is {draft_cfg.vocab_size}, the target's is {target_cfg.vocab_size}: {hint}"
        )
    n_target, n_draft = len(target_tokenizer), len(draft_tokenizer)
    if n_target != n_draft:
        raise DraftMismatchError(f"draft tokenizer has {n_draft} tokens, the target's has {n_target}: {hint}")
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        target_by_id = {i: t for t, i in target_vocab.items()}
        draft_by_id = {i: t for t, i in draft_vocab.items()}
        for i in sorted(set(target_by_id) | set(draft_by_id)):
            if target_by_id.get(i) != draft_by_id.get(i):
                raise DraftMismatchError(
                    f"token id {i} is {draft_by_id.get(i)!r} in the draft tokenizer but "
                    f"{target_by_id.get(i)!r} in the target's: {hint}"
                )
    for name in SPECIAL_TOKENS:
        target_token = getattr(target_tokenizer, f"{name}_token", None)
        draft_token = getattr(draft_tokenizer, f"{name}_token", None)
        target_id = getattr(target_tokenizer, f"{name}_token_id", None)
        draft_id = getattr(draft_tokenizer, f"{name}_token_id", None)
        if (target_token, target_id) != (draft_token, draft_id):
            raise DraftMismatchError(
                f"{name} token differs: the draft's is {draft_token!r} (id {draft_id}), the "
                f"target's {target_token!r} (id {target_id}): {hint}"
            )


def draft_from_settings(
    settings, target_tokenizer, target_cfg, dtype: torch.dtype, device: torch.device | str, max_model_len: int
) -> DraftRunner | None:
    """The DraftRunner of `settings.draft_model` (resolved like the base model: the embedded name, a .gguf file
    or an HF directory), checked against the target's tokenizer and config; None when no draft is set."""
    if not settings.draft_model:
        return None
    from transformers import AutoTokenizer

    from loramux.model.loader import build_model, read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(settings.draft_model, Path(settings.cache_dir))
    draft_cfg, _ = read_model_config(model_dir)
    draft_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_draft_compatible(target_tokenizer, draft_tokenizer, target_cfg, draft_cfg)
    model, _ = build_model(model_dir, dtype, torch.device(device), max_model_len, settings.quantization)
    return DraftRunner(model, settings.draft_kv_cache_bytes, settings.block_size, dtype, device, max_model_len)
