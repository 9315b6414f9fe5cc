"""What an adapter changes in the base model, as JSON-ready data: shown at upload, in the admin API and console.

`describe(adapter, cfg, dtype_bytes)`:

    {"rank": r, "lora_alpha": a, "use_rslora": bool, "scale": alpha / r (or / sqrt(r)),
     "layout": "plain" | "per-module",       # per-module: rank/alpha patterns or a layer subset
     "modules": {target: {"layers": [i, ...], "rank_min": .., "rank_max": .., "scale_min": .., "scale_max": ..}},
     "dora": bool, "embedding": None | {"rank": r}, "heads": [name, ...],
     "device_bytes": {"lora": .., "dora": .., "embedding": .., "heads": .., "total": ..}}

`modules` lists the projections the adapter covers in model order, each with the layers it covers and the
range of its modules' ranks and scales. `device_bytes.lora` is exactly what one slot of the adapter's
device-pool bucket takes at `dtype_bytes` per weight (`pool_layout`: a plain adapter holds every slice of
each merged projection it targets, a per-module one only what it covers, with float32 per-slice scales);
DoRA's scales, the embedding LoRA and trained heads are counted as the pool holds them too (`head_slots`), except
that PEFT's saved copy of an unchanged base embedding, which the pool drops at load, counts here as a head.
"""
from __future__ import annotations

from loramux.adapters.head_slots import extras_bytes, extras_of
from loramux.adapters.peft_format import LoRAAdapter
from loramux.adapters.pool_layout import layer_ranks as layout_of
from loramux.adapters.pool_layout import lora_slot_bytes, path_shapes
from loramux.model.config import ModelConfig
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES


def _tensor_bytes(tensors, dtype_bytes: int) -> int:
    return sum(t.numel() for t in tensors) * dtype_bytes


def _head_name(entry: tuple) -> str:
    """What one extras entry (adapters/head_slots.py) replaces, for people: "lm_head", "embed_tokens",
    "lm_head (tied to embed_tokens)", "lm_head (embedding LoRA, tied)", "embed_tokens tokens (4)"."""
    name = entry[0]
    if name.endswith(".tokens"):
        return f"{name[:-len('.tokens')]} tokens ({entry[1]})"
    if name == "lm_head.lora":
        return "lm_head (embedding LoRA, tied)"
    if entry[1:] == ("tied",):
        return "lm_head (tied to embed_tokens)"
    return name


def _dora_bytes(adapter: LoRAAdapter, paths, table, shapes, num_layers: int, dtype_bytes: int) -> int:
    """DoRA's per-channel scales as the pool holds them: one row of the merged projection's width per (layer,
    path) the slot covers (every layer of `paths`, or the patterned table's entries)."""
    if not adapter.magnitudes:
        return 0
    width = {path: sum(size for _, size in slices) for path, (_, slices) in shapes.items()}
    covered = [path for _, path, _ in table] if table else [p for p in paths for _ in range(num_layers)]
    return sum(width[p] for p in covered) * dtype_bytes


def describe(adapter: LoRAAdapter, cfg: ModelConfig, dtype_bytes: int) -> dict:
    """The adapter's summary (see the module docstring); plain Python types only."""
    modules: dict[str, dict] = {}
    for target in PROJECTION_SLICES:  # model order
        keys = sorted(k for k in adapter.weights if k[1] == target)
        if not keys:
            continue
        ranks = [adapter.weights[k][0].shape[0] for k in keys]
        scales = [adapter.scale_of(k) for k in keys]
        modules[target] = {"layers": [layer for layer, _ in keys], "rank_min": min(ranks), "rank_max": max(ranks),
                           "scale_min": min(scales), "scale_max": max(scales)}
    shapes = path_shapes(cfg)
    table = layout_of(adapter, shapes, cfg.num_layers)
    paths = tuple(p for p in LORA_MODULES if any(PROJECTION_SLICES[t][0] == p for t in modules))
    extras = extras_of(adapter)
    embedding_extras = tuple(e for e in extras if e[0] == "embed_lora")
    head_extras = tuple(e for e in extras if e[0] != "embed_lora")
    device = {
        "lora": lora_slot_bytes(adapter.rank, paths, table, shapes, cfg.num_layers, dtype_bytes),
        "dora": _dora_bytes(adapter, paths, table, shapes, cfg.num_layers, dtype_bytes),
        "embedding": extras_bytes(embedding_extras, cfg.vocab_size, cfg.hidden_size, dtype_bytes),
        "heads": extras_bytes(head_extras, cfg.vocab_size, cfg.hidden_size, dtype_bytes),
    }
    device["total"] = sum(device.values())
    return {
        "rank": adapter.rank, "lora_alpha": float(adapter.alpha), "use_rslora": bool(adapter.use_rslora),
        "scale": adapter.scale, "layout": "per-module" if table else "plain", "modules": modules,
        "dora": bool(adapter.magnitudes),
        "embedding": None if adapter.embedding is None else {"rank": int(adapter.embedding[0].shape[0])},
        "heads": [_head_name(e) for e in head_extras], "device_bytes": device,
    }
