"""How an adapter's LoRA weights are laid out in the device pool: plain, or each module at its own rank.

A plain adapter covers every layer of each projection it targets, at one rank `r`, with one scale: its
bucket key is (rank, merged paths) and a slot holds, per targeted merged projection, every slice at `r`
(a q/v adapter also holds zeros for k; see device_pool). Any other adapter (rank_pattern, alpha_pattern,
layer subsets) is *patterned*: its key's `layer_ranks` lists, for each (layer, merged projection) it
covers, the rank of each slice of that projection in model order, 0 for a slice it leaves alone:

    ((layer, path, (r_slice0, r_slice1, ...)), ...)        e.g. ((0, "self_attn.qkv_proj", (8, 0, 4)), ...)

A patterned slot holds only what is covered: per listed (layer, path) the A rows of its covered slices,
each at its own rank and stacked in slice order, one B per covered slice, and a float32 scale per covered
slice (rank_pattern / alpha_pattern scales differ per module). Uncovered slices, projections and layers hold
nothing and cost nothing. Everything here is pure arithmetic on shapes (the summary and `loramux plan` use
it without a model).

Not every layer has every projection: a hybrid's linear-attention layers have `linear_attn.*` instead of
`self_attn.*`, a mixture-of-experts base's sparse layers the router instead of a dense MLP. A plain adapter covers
every layer that has each projection it targets (`path_layers` counts them), and its slot holds exactly those.
"""
from __future__ import annotations

from collections.abc import Mapping

from loramux.adapters.formats.layer_modules import layer_targets
from loramux.adapters.formats.validation import projection_shapes
from loramux.model.config import ModelConfig
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES

SCALE_BYTES = 4  # a patterned slot's per-slice scales are float32

# path -> (d_in, ((slice name, d_out), ...)) of a merged projection, the same in every layer
PathShapes = Mapping[str, tuple[int, tuple[tuple[str, int], ...]]]


def path_shapes(cfg: ModelConfig) -> dict[str, tuple[int, tuple[tuple[str, int], ...]]]:
    """The merged projections of the engine's decoder for `cfg`, as the pool lays them out."""
    shapes = projection_shapes(cfg)
    out: dict[str, tuple[int, list]] = {}
    for target, (path, slice_name) in PROJECTION_SLICES.items():
        if target not in shapes:  # the router of a mixture-of-experts model only
            continue
        d_in, d_out = shapes[target]
        out.setdefault(path, (d_in, []))[1].append((slice_name, d_out))
    return {path: (d_in, tuple(slices)) for path, (d_in, slices) in out.items()}


def path_layers(cfg: ModelConfig) -> dict[str, int]:
    """How many decoder layers have each merged projection of `path_shapes(cfg)` (0: none has it)."""
    counts = dict.fromkeys(path_shapes(cfg), 0)
    for layer in range(cfg.num_layers):
        # Phi-3's fused checkpoint names stand for the same merged paths as their parts.
        for path in {PROJECTION_SLICES[_FUSED_PARTS.get(t, t)][0] for t in layer_targets(cfg, layer)}:
            counts[path] = counts.get(path, 0) + 1
    return counts


_FUSED_PARTS = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}


def _layer_counts(layers: int | Mapping[str, int], paths) -> Mapping[str, int]:
    """`layers` as a count per path: an int means every layer has every path."""
    return {path: layers for path in paths} if isinstance(layers, int) else layers


class LayerRanks(tuple):
    """A per-module table that computes its hash once: bucket keys are looked up for every projection of
    every step, and a tuple of a few hundred entries would be hashed anew each time (about 20 us)."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached


def layer_ranks(adapter, shapes: PathShapes, layers: int | Mapping[str, int]) -> tuple:
    """The `layer_ranks` of `adapter`'s bucket key: () when it is plain, else its per-module table. `layers`: how many
    layers have each path (`path_layers`), or the number of layers when every layer has every path. Plain: one rank
    and scale, each target on every layer that has it (an adapter's modules are the base's, so counting suffices)."""
    ranks = {key: a.shape[0] for key, (a, _) in adapter.weights.items()}
    targets = {t for _, t in ranks}
    counts = _layer_counts(layers, shapes)
    every_layer = len(ranks) == sum(counts.get(PROJECTION_SLICES[t][0], 0) for t in targets)
    plain = not adapter.module_scales and every_layer and all(r == adapter.rank for r in ranks.values())
    if plain:
        return ()
    table = []
    for layer in range(1 + max((layer for layer, _ in ranks), default=-1)):
        for path in LORA_MODULES:
            if path not in shapes:
                continue
            row = tuple(ranks.get((layer, _target_of(path, name)), 0) for name, _ in shapes[path][1])
            if any(row):
                table.append((layer, path, row))
    return LayerRanks(table)


def _target_of(path: str, slice_name: str) -> str:
    return _TARGET_OF[(path, slice_name)]


_TARGET_OF = {where: target for target, where in PROJECTION_SLICES.items()}


def lora_slot_bytes(rank: int, paths, table: tuple, shapes: PathShapes, layers: int | Mapping[str, int],
                    element: int) -> int:
    """Device bytes of one slot's LoRA weights (and, patterned, its per-slice scales) in a bucket of key
    (rank, paths, table), at `element` bytes per weight; `layers`: how many layers have each path (`path_layers`),
    or the number of layers when every layer has every path."""
    if not table:
        counts = _layer_counts(layers, shapes)
        return rank * sum(counts[p] * (len(shapes[p][1]) * shapes[p][0] + sum(d for _, d in shapes[p][1])) * element
                          for p in paths)
    total = 0
    for _, path, ranks in table:
        d_in, slices = shapes[path]
        total += element * (sum(ranks) * d_in + sum(r * d_out for r, (_, d_out) in zip(ranks, slices)))
        total += SCALE_BYTES * sum(1 for r in ranks if r)
    return total
