"""The device side of embedding LoRA and trained heads (adapters/formats/heads.py): what a pool slot carries beyond the
decoder projections, its exact bytes, and the buffers that hold it.

A bucket's `BucketKey.extras` names it, as a sorted tuple of entries (so adapters whose extras have equal
shapes share a bucket):

  ("embed_lora", r)           embed_a [slots, vocab, r] (A^T: a token's row is one gather), embed_b
                              [slots, r, hidden] (B^T), embed_scale [slots] float32
  ("embed_tokens",)           embed_tokens [slots, vocab, hidden]: a full replacement embedding
  ("lm_head",)                lm_head [slots, hidden, vocab]: a full replacement head (W^T, as MergedLinear)
  ("lm_head", "tied")         the head is the slot's replacement embedding (no buffer of its own)
  ("lm_head.lora",)           the embedding LoRA applies to the tied head too (reads embed_a / embed_b)
  ("<module>.tokens", n)      <module>.token_indices [slots, n] int64 and <module>.token_rows [slots, n, hidden]
"""
from __future__ import annotations

import torch

from loramux.adapters.formats.heads import EMBED, EMBED_KEY, HEAD, TIED_LORA


def extras_of(adapter) -> tuple:
    """`BucketKey.extras` of an adapter (empty for one without embedding LoRA or heads)."""
    out = []
    heads = adapter.heads
    if adapter.embedding is not None:
        out.append(("embed_lora", int(adapter.embedding[0].shape[0])))
    if EMBED in heads:
        out.append((EMBED,))
    if HEAD in heads:
        out.append((HEAD, "tied") if heads[HEAD] is heads.get(EMBED) else (HEAD,))
    if TIED_LORA in heads:
        out.append((TIED_LORA,))
    for module in (EMBED, HEAD):
        if f"{module}.token_indices" in heads:
            out.append((f"{module}.tokens", int(heads[f"{module}.token_indices"].numel())))
    return tuple(sorted(out))


def extras_bytes(extras: tuple, vocab: int, hidden: int, element: int) -> int:
    """Device bytes of one slot's extras (each buffer `allocate` makes, per slot)."""
    total = 0
    for entry in extras:
        name = entry[0]
        if name == "embed_lora":
            total += entry[1] * (vocab + hidden) * element + 4
        elif name in (EMBED, HEAD) and len(entry) == 1:
            total += vocab * hidden * element
        elif name.endswith(".tokens"):
            total += entry[1] * (8 + hidden * element)
    return total


def allocate(extras: tuple, capacity: int, vocab: int, hidden: int, dtype: torch.dtype,
             device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed buffers for `capacity` slots of a bucket with `extras`."""
    zeros = lambda *shape, dt=dtype: torch.zeros(capacity, *shape, dtype=dt, device=device)  # noqa: E731
    buffers: dict[str, torch.Tensor] = {}
    for entry in extras:
        name = entry[0]
        if name == "embed_lora":
            buffers["embed_a"], buffers["embed_b"] = zeros(vocab, entry[1]), zeros(entry[1], hidden)
            buffers["embed_scale"] = zeros(dt=torch.float32)
        elif name == EMBED:
            buffers[EMBED] = zeros(vocab, hidden)
        elif name == HEAD and len(entry) == 1:
            buffers[HEAD] = zeros(hidden, vocab)
        elif name.endswith(".tokens"):
            module = name[:-len(".tokens")]
            buffers[f"{module}.token_indices"] = zeros(entry[1], dt=torch.int64)
            buffers[f"{module}.token_rows"] = zeros(entry[1], hidden)
    return buffers


def write(buffers: dict[str, torch.Tensor], slot: int, adapter) -> None:
    """Copy `adapter`'s embedding LoRA and heads into `slot` of its bucket's buffers."""
    heads = adapter.heads
    for name, buffer in buffers.items():
        if name == "embed_a":
            buffer[slot].copy_(adapter.embedding[0].t(), non_blocking=True)
        elif name == "embed_b":
            buffer[slot].copy_(adapter.embedding[1].t(), non_blocking=True)
        elif name == "embed_scale":
            buffer[slot] = adapter.scale_of(EMBED_KEY)
        elif name == HEAD:
            buffer[slot].copy_(heads[HEAD].t(), non_blocking=True)
        else:
            buffer[slot].copy_(heads[name], non_blocking=True)


def absorb_base_copies(adapter, model) -> None:
    """Resolve PEFT's saved copies of the base embedding (`heads["<module>.base"]`, see adapters/formats/heads.py)
    against the served model, once (in place): equal to the served table, a copy is dropped; different, it
    becomes the adapter's replacement embedding (and, for a tied model, its head: PEFT loads it into the one
    tied parameter)."""
    heads = adapter.heads
    copies = [name for name in (f"{EMBED}.base", f"{HEAD}.base") if name in heads]
    if not copies:
        return
    table = _embedding_table(model)
    tied = model.config.tie_word_embeddings
    for name in copies:
        copy = heads.pop(name)
        if table is not None and (torch.equal(copy, table.float().cpu()) or
                                  torch.equal(copy.to(table.dtype), table.cpu())):
            continue
        module = name[:-len(".base")]
        if module == EMBED or tied:
            heads.setdefault(EMBED, copy)
        if module == HEAD or tied:
            heads.setdefault(HEAD, heads.get(EMBED, copy) if tied else copy)


def _embedding_table(model) -> torch.Tensor | None:
    """The served embedding rows [vocab, hidden] (a tied model's head transposed)."""
    if model.embed_tokens is not None:
        return model.embed_tokens.weight.data
    weight = model.lm_head.weight
    return None if weight is None else weight.data.t()
