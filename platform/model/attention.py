"""Attention over a paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, kv_heads, head_dim]. A sequence owns a
list of blocks (its block table); token t of the sequence lives at slot
`block_table[t // block_size] * block_size + t % block_size`.

A batch is flat: prefill chunks first (one per sequence, any length), then decode tokens (one per
sequence). Prefills run one sequence at a time; decodes run together, gathering each sequence's blocks
and masking the padding.

Per layer, attention may be limited to a sliding window (token i sees keys j with i - j < window, as HF's
`sliding_window_overlay`), its scores soft-capped (cap * tanh(scores / cap), Gemma 2), and each head's softmax
given a learned "sink" logit in its denominator that no value stands behind (gpt-oss); all apply on every
path: fresh prefill, prefill over a cached prefix, speculative verification, decode.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from loramux.model.linear_attention import LinearStates, StateBatch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    end: int  # one past the last row
    context_len: int  # tokens in the cache after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] long
    # The length LongRoPE picks its factors by for every row of the chunk (HF: the forward's longest
    # sequence): the whole prompt for a prompt prefill; None = each row's own position + 1 (decode-like rows).
    rope_len: int | None = None

    @property
    def fresh(self) -> bool:
        """No earlier tokens: attention needs only this chunk's own k/v, causally masked."""
        return self.context_len == self.end - self.start


@dataclass
class DecodeGroup:
    """Decode rows attended together (similar context lengths; see loramux.engine.scheduling.decode_groups)."""

    rows: torch.Tensor  # [Dg] long: indices among the step's decode rows
    block_tables: torch.Tensor  # [Dg, max_blocks_g] long, padded
    mask: torch.Tensor  # [Dg, 1, 1, max_blocks_g * block_size] additive: 0 or -inf
    context_lens: torch.Tensor | None = None  # [Dg] long: tokens each row attends over (for sliding windows)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each token's k/v is written to
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    # Decode rows [num_prefill_tokens, T): padded block tables, a validity mask over gathered keys.
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] additive: 0 or -inf
    # Or the decode rows split into groups of similar context length, each with its own tables and mask.
    decode_groups: list[DecodeGroup] | None = None
    decode_context_lens: torch.Tensor | None = None  # [D] long, rows of decode_block_tables (sliding windows)
    # Masks of windowed layers, made by the first such layer of a step and reused by the rest.
    window_masks: dict = field(default_factory=dict)
    # window -> (tables, mask, context lens) of the decode rows cut to what that window reaches (local layers
    # of a model with global ones too; see ModelRunner._window_decodes). Absent: the full tables, masked.
    window_decodes: dict = field(default_factory=dict)
    # A hybrid's linear-attention layers: where each row's per-sequence state lives (None for other models).
    states: StateBatch | None = None

    @property
    def has_decodes(self) -> bool:
        return self.decode_block_tables is not None or bool(self.decode_groups)


class KVCache:
    """The paged K/V pool for all layers: [layers, num_blocks, block_size, kv_heads, head_dim] each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.states: LinearStates | None = None  # a hybrid's per-sequence linear-attention states (set by the runner)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (already rotated) -> output [T, H, D]; writes k/v into the cache.
    `window`: each query sees only the `window` latest keys (itself included); `softcap`: scores are
    soft-capped before the softmax; `sinks` [H]: each head's sink logit (see the module docstring)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)

    d0 = meta.num_prefill_tokens
    if not meta.prefills:  # pure decode step: no scatter into a shared output buffer needed
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        # 4-D [1, H, L, D]: with 3-D input CPU SDPA falls back to its unfused math path (about 3x slower).
        qs = q[chunk.start:chunk.end].transpose(0, 1)[None]
        if chunk.fresh and window is None and softcap is None and sinks is None:
            ks = k[chunk.start:chunk.end].transpose(0, 1)[None]
            vs = v[chunk.start:chunk.end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        elif chunk.fresh:
            ks = k[chunk.start:chunk.end].transpose(0, 1)[None]
            vs = v[chunk.start:chunk.end].transpose(0, 1)[None]
            length = chunk.end - chunk.start
            o = attend(qs, ks, vs, _causal_mask(length, length, window, q.device), scale, softcap, sinks)
        else:
            # Earlier tokens are in the cache: query i sits at absolute position ctx - L + i.
            n = chunk.context_len
            ks = gather_blocks(k_cache, chunk.block_table, "k").view(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            vs = gather_blocks(v_cache, chunk.block_table, "v").view(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            o = attend(qs, ks, vs, _causal_mask(chunk.end - chunk.start, n, window, q.device), scale, softcap, sinks)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)

    if meta.has_decodes and d0 < q.shape[0]:
        out[d0:] = _decode_attention(q[d0:], k_cache, v_cache, meta, scale, window, softcap, sinks)
    return out


def _causal_mask(num_queries: int, num_keys: int, window: int | None, device) -> torch.Tensor:
    """Bool [L, n]: the L queries are the last L of n positions; True where query i may see key j."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, H, L, D] over k/v [B, KVH, n, D] (grouped heads) with a bool or additive mask.
    Without `softcap` and `sinks` this is SDPA; with them it is computed as HF's eager paths do: scores x scale,
    soft-capped (/ cap, tanh, x cap), + mask, softmax in float32; with `sinks` [H] each head's sink logit joins
    the softmax as one more column (after subtracting the row maximum, as gpt-oss does) and is then dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class _Scratch(threading.local):
    """Reused CPU buffers for the gathered K and V of one layer at a time (layers run one after another; one
    set per thread, as each engine steps on its own thread).
    A fresh multi-MB tensor per gather can be fresh pages from the OS, whose first touch (page faults,
    zeroing) costs more than the copy in a VM: under torch's profiler a gather of ~300 blocks in a serving-like
    step took 6-8 ms into a new tensor and 0.08 ms into a reused one (wall-clock the step gained about 15 %)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, which: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (which, width, dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = self.buffers[key] = torch.empty(max(rows, 2 * (buf.shape[0] if buf is not None else 0)), width,
                                                  dtype=dtype)
        return buf[:rows]


_SCRATCH = _Scratch()


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, which: str = "k") -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, head_dim] -> the listed blocks, [len(blocks), block_size *
    kv_heads * head_dim]. The gather runs on a 2-D view of the cache: CPU index_select copies whole rows of a
    2-D tensor but walks a 4-D one element by element, 5-10x slower (0.26 vs 0.055 ms for 266 blocks of
    SmolLM2's KV). On CPU the result lands in a buffer reused by the next layer's gather (`_Scratch`): use it
    before gathering the same `which` again."""
    flat = cache.view(cache.shape[0], -1)
    if cache.device.type != "cpu" or torch.is_grad_enabled():
        return flat.index_select(0, blocks)
    return torch.index_select(flat, 0, blocks, out=_SCRATCH.get(which, blocks.shape[0], flat.shape[1], flat.dtype))


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None,
                      softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its gathered blocks; q [D, H, Dh] -> [D, H, Dh]."""
    if window in meta.window_decodes:
        tables, mask, lens = meta.window_decodes[window]
        mask = _windowed(meta, "cut", mask, lens, window)
        return _attend_blocks(q, k_cache, v_cache, tables, mask, scale, softcap, sinks)
    if not meta.decode_groups:
        mask = _windowed(meta, -1, meta.decode_mask, meta.decode_context_lens, window)
        return _attend_blocks(q, k_cache, v_cache, meta.decode_block_tables, mask, scale, softcap, sinks)
    out = torch.empty_like(q)
    for index, group in enumerate(meta.decode_groups):
        mask = _windowed(meta, index, group.mask, group.context_lens, window)
        o = _attend_blocks(q.index_select(0, group.rows), k_cache, v_cache, group.block_tables, mask, scale, softcap,
                           sinks)
        out.index_copy_(0, group.rows, o)
    return out


def _windowed(meta: AttentionMetadata, group: int, mask: torch.Tensor, context_lens: torch.Tensor | None,
              window: int | None) -> torch.Tensor:
    """The decode mask with keys older than the window masked too (made once per step, group and window)."""
    if window is None:
        return mask
    key = (group, window)
    if key not in meta.window_masks:
        if context_lens is None:
            raise ValueError("a sliding-window layer needs the decode rows' context lengths in the metadata")
        keys = torch.arange(mask.shape[-1], device=mask.device)[None, :]
        too_old = keys <= (context_lens[:, None] - 1 - window)
        meta.window_masks[key] = mask.masked_fill(too_old[:, None, None, :], float("-inf"))
    return meta.window_masks[key]


def _attend_blocks(q, k_cache, v_cache, tables: torch.Tensor, mask: torch.Tensor, scale: float,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    _, _, kv_heads, head_dim = k_cache.shape
    num_seqs = tables.shape[0]
    flat_tables = tables.view(-1)
    ks = gather_blocks(k_cache, flat_tables, "k").view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    vs = gather_blocks(v_cache, flat_tables, "v").view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    return attend(q.unsqueeze(2), ks, vs, mask, scale, softcap, sinks).squeeze(2)
