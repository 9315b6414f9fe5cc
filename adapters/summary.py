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
the other parts count their tensors (DoRA magnitudes, embedding LoRA A/B, trained heads) at `dtype_bytes`.
"""
from __future__ import annotations

from loramux.adapters.peft_format import LoRAAdapter
from loramux.adapters.pool_layout import layer_ranks as layout_of
from loramux.adapters.pool_layout import lora_slot_bytes, path_shapes
from loramux.model.config import ModelConfig
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES


def _tensor_bytes(tensors, dtype_bytes: int) -> int:
    return sum(t.numel() for t in tensors) * dtype_bytes


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
    device = {
        "lora": lora_slot_bytes(adapter.rank, paths, table, shapes, cfg.num_layers, dtype_bytes),
        "dora": _dora_bytes(adapter, paths, table, shapes, cfg.num_layers, dtype_bytes),
        "embedding": _tensor_bytes(adapter.embedding or (), dtype_bytes),
        "heads": _tensor_bytes(adapter.heads.values(), dtype_bytes),
    }
    device["total"] = sum(device.values())
    return {
        "rank": adapter.rank, "lora_alpha": float(adapter.alpha), "use_rslora": bool(adapter.use_rslora),
        "scale": adapter.scale, "layout": "per-module" if table else "plain", "modules": modules,
        "dora": bool(adapter.magnitudes),
        "embedding": None if adapter.embedding is None else {"rank": int(adapter.embedding[0].shape[0])},
        "heads": sorted(adapter.heads), "device_bytes": device,
    }
