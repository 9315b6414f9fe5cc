"""Attention over a paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, kv_heads, head_dim]. A sequence owns a
list of blocks (its block table); token t of the sequence lives at slot
`block_table[t // block_size] * block_size + t % block_size`.

A batch is flat: prefill chunks first (one per sequence, any length), then decode tokens (one per
sequence). Prefills run one sequence at a time; decodes run together, gathering each sequence's blocks
and masking the padding.
"""
from __future__ import annotations

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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each token's k/v is written to
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    # Decode rows [num_prefill_tokens, T): padded block tables, a validity mask over gathered keys.
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] additive: 0 or -inf


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
            ks = k_cache[chunk.block_table].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            vs = v_cache[chunk.block_table].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
            length = chunk.end - chunk.start
            q_pos = torch.arange(n - length, n, device=q.device).unsqueeze(1)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)

    if meta.decode_block_tables is not None and d0 < q.shape[0]:
        out[d0:] = _decode_attention(q[d0:], k_cache, v_cache, meta, scale)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence against its gathered blocks; q [D, H, Dh] -> [D, H, Dh]."""
    _, _, kv_heads, head_dim = k_cache.shape
    tables = meta.decode_block_tables
    num_seqs = tables.shape[0]
    flat_tables = tables.view(-1)
    # index_select on the block dim is a plain row gather, cheaper than advanced indexing on CPU.
    ks = k_cache.index_select(0, flat_tables).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    vs = v_cache.index_select(0, flat_tables).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)
