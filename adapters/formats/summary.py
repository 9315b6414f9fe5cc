"""What an adapter changes in the base model, as JSON-ready data: shown at upload, in the admin API and console.

`describe(adapter, cfg, dtype_bytes)`:

    {"rank": r, "lora_alpha": a, "use_rslora": bool, "scale": alpha / r (or / sqrt(r)),
     "layout": "plain" | "per-module",       # per-module: rank/alpha patterns or a layer subset
     "modules": {target: {"layers": [i, ...], "rank_min": .., "rank_max": .., "scale_min": .., "scale_max": ..}},
     "dora": bool, "embedding": None | {"rank": r}, "heads": [name, ...],
     "experts": {"gate_up" | "down": {"rank": R, "layers": [i, ...]}},   # LoRA on routed experts (MoE bases)
     "device_bytes": {"lora": .., "dora": .., "embedding": .., "heads": .., "experts": .., "total": ..}}

`modules` lists the projections the adapter covers in model order, each with the layers it covers and the
range of its modules' ranks and scales. `device_bytes.lora` is exactly what one slot of the adapter's
device-pool bucket takes at `dtype_bytes` per weight (`pool_layout`: a plain adapter holds every slice of
each merged projection it targets, a per-module one only what it covers, with float32 per-slice scales);
DoRA's scales, the embedding LoRA and trained heads are counted as the pool holds them too (`head_slots`).
PEFT's saved copies of the base weights (`embed_tokens.base_layer.weight`, `lm_head.base_layer.weight`:
adapters/formats/heads.py) serve as a replacement embedding / head when they differ from the served weights, which the
pool finds out only at load (`head_slots.absorb_base_copies`), so here each counts as that replacement, in
`heads` ("embed_tokens (saved base copy)", "lm_head (tied to embed_tokens, saved base copy)") and in
`device_bytes.heads`: an adapter that may replace a head never looks like a plain LoRA (the composition
pre-check reads `embedding` and `heads`).
"""
from __future__ import annotations

from types import SimpleNamespace

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency import expert_slots
from loramux.adapters.residency.head_slots import absorb_base_copies, extras_bytes, extras_of
from loramux.adapters.residency.pool_layout import layer_ranks as layout_of
from loramux.adapters.residency.pool_layout import lora_slot_bytes, path_layers, path_shapes
from loramux.model.config import ModelConfig
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES


def _tensor_bytes(tensors, dtype_bytes: int) -> int:
    return sum(t.numel() for t in tensors) * dtype_bytes


def _head_name(entry: tuple, base_copy: bool = False) -> str:
    """What one extras entry (adapters/residency/head_slots.py) replaces, for people: "lm_head", "embed_tokens",
    "lm_head (tied to embed_tokens)", "lm_head (embedding LoRA, tied)", "embed_tokens tokens (4)"; with
    `base_copy` (the entry comes from PEFT's saved copy of the base weight): "embed_tokens (saved base copy)",
    "lm_head (tied to embed_tokens, saved base copy)"."""
    name = _head_label(entry)
    if not base_copy:
        return name
    return f"{name[:-1]}, saved base copy)" if name.endswith(")") else f"{name} (saved base copy)"


def _head_label(entry: tuple) -> str:
    name = entry[0]
    if name.endswith(".tokens"):
        return f"{name[:-len('.tokens')]} tokens ({entry[1]})"
    if name == "lm_head.lora":
        return "lm_head (embedding LoRA, tied)"
    if entry[1:] == ("tied",):
        return "lm_head (tied to embed_tokens)"
    return name


def _with_base_copies(adapter: LoRAAdapter, cfg: ModelConfig) -> tuple[tuple, frozenset]:
    """(the adapter's extras with its saved base copies taken as replacements, the entries only the copies
    add): `absorb_base_copies` on a copy of the heads, against a model whose weights are unknown (no table to
    compare with, so every copy is kept, as one that differs from the served weights is)."""
    if not any(name.endswith(".base") for name in adapter.heads):
        return extras_of(adapter), frozenset()
    probe = SimpleNamespace(embedding=adapter.embedding, heads=dict(adapter.heads))
    unknown = SimpleNamespace(embed_tokens=None, lm_head=SimpleNamespace(weight=None), config=cfg)
    absorb_base_copies(probe, unknown)
    extras = extras_of(probe)
    return extras, frozenset(extras) - frozenset(extras_of(adapter))


def _dora_bytes(adapter: LoRAAdapter, paths, table, shapes, layers: dict[str, int], dtype_bytes: int) -> int:
    """DoRA's per-channel scales as the pool holds them: one row of the merged projection's width per (layer,
    path) the slot covers (every layer that has a path of `paths`, or the patterned table's entries)."""
    if not adapter.magnitudes:
        return 0
    width = {path: sum(size for _, size in slices) for path, (_, slices) in shapes.items()}
    covered = [path for _, path, _ in table] if table else [p for p in paths for _ in range(layers[p])]
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
    shapes, layers = path_shapes(cfg), path_layers(cfg)
    table = layout_of(adapter, shapes, layers)
    paths = tuple(p for p in LORA_MODULES if any(PROJECTION_SLICES[t][0] == p for t in modules))
    extras, copies = _with_base_copies(adapter, cfg)
    embedding_extras = tuple(e for e in extras if e[0] == "embed_lora")
    head_extras = tuple(e for e in extras if e[0] != "embed_lora")
    device = {
        "lora": lora_slot_bytes(adapter.rank, paths, table, shapes, layers, dtype_bytes),
        "dora": _dora_bytes(adapter, paths, table, shapes, layers, dtype_bytes),
        "embedding": extras_bytes(embedding_extras, cfg.vocab_size, cfg.hidden_size, dtype_bytes),
        "heads": extras_bytes(head_extras, cfg.vocab_size, cfg.hidden_size, dtype_bytes),
        "experts": expert_slots.slot_bytes(expert_slots.key_of(adapter), cfg, dtype_bytes),
    }
    experts: dict[str, dict] = {}
    for (layer, name), (a, _) in sorted(adapter.experts.items()):
        experts.setdefault(name, {"rank": int(a.shape[1]), "layers": []})["layers"].append(layer)
    device["total"] = sum(device.values())
    return {
        "rank": adapter.rank, "lora_alpha": float(adapter.alpha), "use_rslora": bool(adapter.use_rslora),
        "scale": adapter.scale, "layout": "per-module" if table else "plain", "modules": modules,
        "dora": bool(adapter.magnitudes),
        "embedding": None if adapter.embedding is None else {"rank": int(adapter.embedding[0].shape[0])},
        "heads": [_head_name(e, e in copies) for e in head_extras], "experts": experts, "device_bytes": device,
    }
