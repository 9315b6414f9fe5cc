"""Per-row embedding and output-head ops for adapters that train them (torch; CPU and GPU alike).

Rows are given as `rows` (long [n], indices into the step's flat rows) with their adapter `slots` (long [n]);
stacks are indexed by slot first. Semantics, per given row i, token t = ids[rows[i]], slot s = slots[i]:

    replace_rows:        x[rows[i]] = table[s, t]                                   (a replacement embedding)
    replace_token_rows:  x[rows[i]] = values[s, j] where indices[s, j] == t, else unchanged   (trainable tokens)
    embedding_lora:      x[rows[i]] += (a[s, t] @ b[s]) * scale[s] * out_scale   (a = A^T [vocab, r], b = B^T)
    head_logits:         logits[p] = h[p] @ w[s]  for the positions p of slot s    (a replacement head, w = W^T)
    token_logits:        logits[p, indices[s, j]] = h[p] @ values[s, j]            (trainable tokens of the head)
    head_lora:           logits[p] += ((h[p] @ b[s]^T) @ a[s]^T) * scale[s]       (the tied head's LoRA)

None of them syncs with the device (no data-dependent shapes), so they run inside a step as is.
"""
from __future__ import annotations

import torch


def replace_rows(x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                 table: torch.Tensor) -> None:
    x.index_copy_(0, rows, table[slots, ids.index_select(0, rows)].to(x.dtype))


def replace_token_rows(x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                       indices: torch.Tensor, values: torch.Tensor) -> None:
    tokens = ids.index_select(0, rows)
    match = indices.index_select(0, slots) == tokens[:, None]  # [n, k]: token ids are distinct per slot
    new = values[slots, match.to(torch.int32).argmax(1)].to(x.dtype)
    x.index_copy_(0, rows, torch.where(match.any(1)[:, None], new, x.index_select(0, rows)))


def embedding_lora(x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, scale: torch.Tensor, out_scale: torch.Tensor | None = None) -> None:
    after_a = a[slots, ids.index_select(0, rows)]  # [n, r]: PEFT's F.embedding(x, A^T)
    delta = torch.bmm(after_a.unsqueeze(1), b.index_select(0, slots)).squeeze(1)
    delta = delta * scale.index_select(0, slots).to(delta.dtype)[:, None]
    if out_scale is not None:  # Gemma's scaled embeddings: PEFT scales the delta as the base rows
        delta = delta * out_scale
    x.index_add_(0, rows, delta.to(x.dtype))


def head_logits(logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, w: torch.Tensor) -> None:
    logits.index_copy_(0, positions, (hidden.index_select(0, positions) @ w).to(logits.dtype))


def token_logits(logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 indices: torch.Tensor, values: torch.Tensor) -> None:
    h = hidden.index_select(0, positions).unsqueeze(1)  # [n, 1, hidden]
    scores = torch.bmm(h, values.index_select(0, slots).transpose(1, 2)).squeeze(1)  # [n, k]
    logits[positions[:, None], indices.index_select(0, slots)] = scores.to(logits.dtype)


def head_lora(logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor, scale: torch.Tensor) -> None:
    """One slot's rows: a = A^T [vocab, r], b = B^T [r, hidden], scale a 0-d tensor."""
    v = hidden.index_select(0, positions) @ b.t()
    logits.index_add_(0, positions, ((v @ a.t()) * scale.to(v.dtype)).to(logits.dtype))
