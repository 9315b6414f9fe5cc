"""Attention over a paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, kv_heads, head_dim]. A sequence owns a
list of blocks (its block table); token t of the sequence lives at slot
`block_table[t // block_size] * block_size + t % block_size`.

A batch is flat: prefill chunks first (one per sequence, any length), then decode tokens (one per
sequence). Prefills run one sequence at a time; decodes run together, gathering each sequence's blocks
and masking the padding.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    end: int  # one past the last row
    context_len: int  # tokens in the cache after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] long

    @property
    def fresh(self) -> bool:
        """No earlier tokens: attention needs only this chunk's own k/v, causally masked."""
        return self.context_len == self.end - self.start


@dataclass
class DecodeGroup:
    """Decode rows attended together (similar context lengths; see loramux.engine.decode_groups)."""

    rows: torch.Tensor  # [Dg] long: indices among the step's decode rows
    block_tables: torch.Tensor  # [Dg, max_blocks_g] long, padded
    mask: torch.Tensor  # [Dg, 1, 1, max_blocks_g * block_size] additive: 0 or -inf


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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (already rotated) -> output [T, H, D]; writes k/v into the cache."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)

    d0 = meta.num_prefill_tokens
    if not meta.prefills:  # pure decode step: no scatter into a shared output buffer needed
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        # 4-D [1, H, L, D]: with 3-D input CPU SDPA falls back to its unfused math path (about 3x slower).
        qs = q[chunk.start:chunk.end].transpose(0, 1)[None]
        if chunk.fresh:
            ks = k[chunk.start:chunk.end].transpose(0, 1)[None]
            vs = v[chunk.start:chunk.end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Earlier tokens are in the cache: query i sits at absolute position ctx - L + i.
            n = chunk.context_len
            ks = gather_blocks(k_cache, chunk.block_table, "k").view(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            vs = gather_blocks(v_cache, chunk.block_table, "v").view(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            length = chunk.end - chunk.start
            q_pos = torch.arange(n - length, n, device=q.device).unsqueeze(1)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)

    if meta.has_decodes and d0 < q.shape[0]:
        out[d0:] = _decode_attention(q[d0:], k_cache, v_cache, meta, scale)
    return out


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


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence against its gathered blocks; q [D, H, Dh] -> [D, H, Dh]."""
    if not meta.decode_groups:
        return _attend_blocks(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        o = _attend_blocks(q.index_select(0, group.rows), k_cache, v_cache, group.block_tables, group.mask, scale)
        out.index_copy_(0, group.rows, o)
    return out


def _attend_blocks(q, k_cache, v_cache, tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    _, _, kv_heads, head_dim = k_cache.shape
    num_seqs = tables.shape[0]
    flat_tables = tables.view(-1)
    ks = gather_blocks(k_cache, flat_tables, "k").view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    vs = gather_blocks(v_cache, flat_tables, "v").view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
