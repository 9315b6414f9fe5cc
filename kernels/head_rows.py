"""One step's rows of adapters that carry an embedding LoRA or trained heads (`BucketKey.extras`, see
loramux.adapters.residency.head_slots), and the two model entry points that serve them through the LoRA wrapper:

* `embed(x, ids, embed_scale)`: the step's embeddings [T, hidden], before the model's embedding scale.
  Replacement rows first (a trained embedding, trainable tokens), then the scale (Gemma), then the LoRA
  delta, scaled as well: PEFT's order, where the scale sits inside the embedding module.
* `logits(hidden, base_head)`: the logits of the rows to sample. The base head runs only for the rows
  without a replacement head; a replacement head only for its adapter's rows; then trainable token
  columns and the tied head's LoRA. The model soft-caps afterwards, as for the base head.

Rows of other adapters and of the base model are never touched.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from loramux.kernels import head_ops

_EMBED_ENTRIES = ("embed_lora", "embed_tokens", "embed_tokens.tokens")
_HEAD_ENTRIES = ("lm_head", "lm_head.tokens", "lm_head.lora")


class _Group:
    """The rows of one bucket with extras: flat rows and slots, as lists and device tensors."""

    def __init__(self, bucket, rows: list[int], slots: list[int], device: torch.device):
        names = {entry[0] for entry in bucket.extras}
        self.bucket, self.rows, self.slots = bucket, rows, slots
        self.embeds = bool(names & set(_EMBED_ENTRIES))
        self.heads = bool(names & set(_HEAD_ENTRIES))
        self.full_head = "lm_head" in names
        self.tied_head = ("lm_head", "tied") in bucket.extras
        self.rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        self.slots_t = torch.tensor(slots, dtype=torch.long, device=device)
        self.positions: dict[int, list[int]] = {}  # slot -> positions among the logits rows


class StepHeads:
    """Built by `LoRAWrapper.set_batch` when a row's bucket has extras; `extras_of(bucket)` gives its buffers."""

    def __init__(self, locations: Sequence, extras_of: Callable[[object], dict], device: torch.device):
        by_bucket: dict[object, tuple[list[int], list[int]]] = {}
        for row, location in enumerate(locations):
            if location is not None and getattr(location[0], "extras", ()):
                rows, slots = by_bucket.setdefault(location[0], ([], []))
                rows.append(row)
                slots.append(location[1])
        self.device = device
        self.extras_of = extras_of
        self.groups = [_Group(bucket, rows, slots, device) for bucket, (rows, slots) in by_bucket.items()]
        self.embeds = any(g.embeds for g in self.groups)
        self.heads = False  # set by set_logit_rows

    def set_logit_rows(self, logit_rows: Sequence[int]) -> None:
        """The flat rows whose logits the step computes, in logits order."""
        position = {row: i for i, row in enumerate(logit_rows)}
        for g in self.groups:
            g.positions = {}
            for row, slot in zip(g.rows, g.slots):
                if row in position:
                    g.positions.setdefault(slot, []).append(position[row])
        self.heads = any(g.heads and g.positions for g in self.groups)

    # -- the embedding -------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, ids: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
        for g in self.groups:
            buffers = self.extras_of(g.bucket)
            if "embed_tokens" in buffers:
                head_ops.replace_rows(x, ids, g.rows_t, g.slots_t, buffers["embed_tokens"])
            if "embed_tokens.token_indices" in buffers:
                head_ops.replace_token_rows(x, ids, g.rows_t, g.slots_t, buffers["embed_tokens.token_indices"],
                                            buffers["embed_tokens.token_rows"])
        scale = None
        if embed_scale is not None:
            scale = torch.tensor(embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as HF does
            x = x * scale
        for g in self.groups:
            buffers = self.extras_of(g.bucket)
            if "embed_a" in buffers:
                head_ops.embedding_lora(x, ids, g.rows_t, g.slots_t, buffers["embed_a"], buffers["embed_b"],
                                        buffers["embed_scale"], None if scale is None else scale.to(x.device))
        return x

    # -- the head ------------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor, base_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        replaced = sorted(p for g in self.groups if g.full_head for ps in g.positions.values() for p in ps)
        if not replaced:
            logits = base_head(hidden)
        else:
            base_rows = sorted(set(range(hidden.shape[0])) - set(replaced))
            logits = None
            if base_rows:
                index = torch.tensor(base_rows, dtype=torch.long, device=hidden.device)
                base = base_head(hidden.index_select(0, index))
                logits = base.new_empty(hidden.shape[0], base.shape[1])
                logits.index_copy_(0, index, base)
        for g in self.groups:
            if not g.heads or not g.positions:
                continue
            buffers = self.extras_of(g.bucket)
            per_slot = [(slot, torch.tensor(ps, dtype=torch.long, device=hidden.device))
                        for slot, ps in g.positions.items()]
            if g.full_head:
                for slot, positions in per_slot:
                    w = buffers["embed_tokens"][slot].t() if g.tied_head else buffers["lm_head"][slot]
                    if logits is None:
                        logits = hidden.new_empty(hidden.shape[0], w.shape[1])
                    head_ops.head_logits(logits, hidden, positions, w)
            if "lm_head.token_indices" in buffers:
                positions = torch.cat([p for _, p in per_slot])
                slots = torch.tensor([s for s, p in per_slot for _ in range(p.numel())], dtype=torch.long,
                                     device=hidden.device)
                head_ops.token_logits(logits, hidden, positions, slots, buffers["lm_head.token_indices"],
                                      buffers["lm_head.token_rows"])
            if ("lm_head.lora",) in g.bucket.extras:
                for slot, positions in per_slot:
                    head_ops.head_lora(logits, hidden, positions, buffers["embed_a"][slot], buffers["embed_b"][slot],
                                       buffers["embed_scale"][slot])
        return logits
