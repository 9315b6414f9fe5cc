"""Merging stored LoRA adapters into one new adapter, by PEFT's own `add_weighted_adapter`.

`check_request` checks the method and its parameters, `check_components` the adapters against the method's
preconditions (both raise `MergeError`, a 400 naming the parameter or component and what to fix), and
`merge` runs the merge and returns the merged adapter as PEFT's two files, for the upload path to validate
and store. Nothing here touches the registry: it is pure and testable alone.

Methods (PEFT's `combination_type`):

  cat          exact: A matrices stacked (each times weight x its scale), B side by side; rank = sum of ranks.
  linear       A and B each averaged with weights sqrt(weight x scale); needs equal ranks. Deterministic and
               exactly PEFT's, but the product of averages is not the average of the products (PEFT calls it a
               rough approximation unless the components share their A or B).
  ties         TIES-merging of A and B (trim to `density`, elect a sign by `majority_sign_method`, disjoint
               mean); equal ranks.
  dare_linear  DARE: random drop of 1 - `density` of the entries, rescale, then linear; equal ranks; random.
  dare_ties    DARE then TIES sign election; equal ranks; random.
  svd          the weighted sum of the delta weights (B A x scale), truncated by SVD to `svd_rank` (default: the
               largest component rank); `svd_clamp` clamps to a quantile.

Where a merge runs, and its bounds (`MergeLimits`, LORAMUX_MERGE_*). `cat` and `linear` touch LoRA tensors only
(rank concatenation, averages of A and B) and run in the calling process. `ties`, `dare_*` and `svd` run in a
worker process (`loramux.adapters.composition.merge_worker`, a fresh one per merge: nothing of the serving process is
forked,
and its memory is all returned when it exits) from a bounded pool: at most `workers` at once, each under RLIMIT_AS
= its address space after its imports + `memory_bytes`, killed (and reaped) past `timeout_s` of wall time from its
start. Components go to it as `pack`ed blob bytes and the result comes back as bytes, both through its stdin and
stdout pipes: no shared memory (/dev/shm is 64 MB in a Docker container), no temporary files. Before anything
starts, `check_memory` estimates the merge's peak (`peak_bytes`) and refuses one above `memory_bytes` with a
`MergeTooLarge` (413) naming the bound and the setting that raises it. The estimate's big term is svd's: PEFT
builds each component's dense d_out x d_in delta per module (three copies of each in its weighted sum) before the
SVD, which runs with `svd_full_matrices=False` (a thin U of d_out x min(d_out, d_in), not d_out x d_out).

DARE draws its masks from torch's global generator: in the worker it is seeded with `seed` (a request without one
gets a random seed, recorded), so the same request gives the same bytes, equal to what PEFT gives after
`torch.manual_seed(seed)` on a real PeftModel of the base model with the same components (the skeleton defines the
projections in the order HF's model classes do, which PEFT follows). In the serving process the engine's unseeded
sampling draws from that generator too (from another thread), so a seed there would not make the masks
reproducible.

PEFT needs a PeftModel to merge in. It is built on a skeleton of the base model: its projections by their
own names and shapes, the LoRA weights real, no base weights loaded. Not on the meta device: PEFT moves a new
adapter's layers to the device of the base layer, and on meta the `cat` merge writes into meta tensors (no
data). Each base weight is instead one zero scalar broadcast to the projection's shape (a stride-0 view:
no memory), so PEFT keeps everything on the CPU. Only LoRA weights enter a merge (`get_delta_weight` for svd
reads A and B only), so the skeleton gives PEFT's exact numbers; memory is the components' and the result's
LoRA tensors, and for svd the dense deltas of one module at a time (see `peak_bytes`).

Refused by name, because `add_weighted_adapter` would drop or mis-merge them: DoRA (magnitude vectors), LoRA
on embed_tokens, trained heads and trainable tokens; and LoRA on the routed experts or the router of a
mixture-of-experts base (`LoRAAdapter.experts`: the skeleton has no experts to merge them in). A merged adapter
has one rank for every module (PEFT's rank_pattern is emptied), lora_alpha = r, and use_rslora of the first
component (PEFT's rule).
"""
from __future__ import annotations

import json
import math
import pickle
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.formats.validation import (
    FUSED_TARGETS,
    AdapterValidationError,
    base_targets,
    checkpoint_shapes,
    module_names,
)
from loramux.child_python import python_command
from loramux.model.config import ModelConfig

__all__ = ["EXACT_METHODS", "METHODS", "MAX_COMPONENTS", "WORKER_METHODS", "MergeBusy", "MergeComponent",
           "MergeError", "MergeLimits", "MergeTooLarge", "MergedAdapter", "check_components", "check_memory",
           "check_request", "merge", "merged_rank", "peak_bytes"]

# PEFT's names for them (add_weighted_adapter's combination_type).
Method = Literal["cat", "linear", "ties", "dare_linear", "dare_ties", "svd"]
METHODS: tuple[Method, ...] = ("cat", "linear", "ties", "dare_linear", "dare_ties", "svd")
EXACT_METHODS = ("cat", "linear")
# The methods that run in a worker process: svd builds dense deltas; ties and DARE are LoRA-sized but sort, trim
# and (DARE) draw from torch's global generator. cat and linear only concatenate or average A and B.
WORKER_METHODS = ("ties", "dare_linear", "dare_ties", "svd")
# The parameters each method takes (anything else is refused, so a typo never goes unnoticed).
PARAMETERS = {"cat": (), "linear": (), "ties": ("density", "majority_sign_method"),
              "dare_linear": ("density", "seed"), "dare_ties": ("density", "majority_sign_method", "seed"),
              "svd": ("svd_rank", "svd_clamp")}
_EQUAL_RANKS = ("linear", "ties", "dare_linear", "dare_ties")
_DENSITY = ("ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")
# The order HF's Phi-3 defines its projections in (o_proj before qkv_proj), which is the order PEFT visits them
# and DARE draws its masks in; Qwen3.5's linear-attention layers define out_proj before their input projections;
# the other families define theirs in base_targets' order.
_PHI3_ORDER = ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
_QWEN3_5_LINEAR_ORDER = ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
MAX_COMPONENTS = 16
MAX_SEED = 2**63 - 1
MERGED = "merged"


class MergeError(AdapterValidationError):
    """A merge refused before any work: `param` names the request field (method, parameters.density,
    components[1], ...) and the message says what to fix. Answered as a 400."""

    code_name = "invalid_merge"

    def __init__(self, param: str, message: str):
        super().__init__(self.code_name, message)
        self.param = param

    def __reduce__(self):
        return type(self), (self.param, str(self))


class MergeTooLarge(MergeError):
    """A merge above one of this server's bounds (LORAMUX_MERGE_MEMORY_BYTES, LORAMUX_MERGE_TIMEOUT_S): refused
    before it starts when the estimate says so, else stopped (its worker killed). Answered as a 413; the message
    names the bound and the setting that raises it."""

    code_name = "too_large"


class MergeBusy(MergeError):
    """Every merge worker stayed busy for LORAMUX_MERGE_TIMEOUT_S: nothing ran; retry later (a 503)."""

    code_name = "merge_busy"


@dataclass(frozen=True)
class MergeLimits:
    """How merges run in worker processes (LORAMUX_MERGE_*; see the module docstring)."""

    memory_bytes: int = 4 * 1024**3  # the most a merge may allocate (its estimate, and the worker's RLIMIT_AS)
    timeout_s: float = 600.0  # wall clock of one worker, its start included; also the longest wait for one
    workers: int = 1  # worker merges that run at once

    @classmethod
    def from_settings(cls, settings) -> MergeLimits:
        return cls(memory_bytes=settings.merge_memory_bytes, timeout_s=settings.merge_timeout_s,
                   workers=settings.merge_workers)


@dataclass(frozen=True)
class MergeComponent:
    """One adapter of a merge: its weights, its weight in the merge and how messages name it."""

    label: str
    adapter: LoRAAdapter
    weight: float


@dataclass(frozen=True)
class MergedAdapter:
    """The merge's result as PEFT writes an adapter (adapter_config.json, adapter_model.safetensors)."""

    config: bytes
    weights: bytes
    rank: int

    def files(self) -> dict[str, bytes]:
        return {"adapter_config.json": self.config, "adapter_model.safetensors": self.weights}


# ---------------------------------------------------------------------------------------------- checks

def check_request(method, parameters: Mapping | None, weights: Sequence) -> dict:
    """Check the method, its parameters and the components' weights (before anything is loaded); return the
    parameters the merge runs with: the given ones, and for DARE the seed (a random one when not given)."""
    if method not in METHODS:
        raise MergeError("method", f"method must be one of {', '.join(METHODS)}, got {str(method)[:40]!r}")
    params = {k: v for k, v in (parameters or {}).items() if v is not None}
    allowed = PARAMETERS[method]
    for name in params:
        if name not in allowed:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no parameters"
            raise MergeError(f"parameters.{name}", f"parameter {str(name)[:40]!r} does not apply to method {method} "
                                                  f"(it {takes}); remove it")
    if not 2 <= len(weights) <= MAX_COMPONENTS:
        raise MergeError("components", f"a merge takes 2 to {MAX_COMPONENTS} components, got {len(weights)}")
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise MergeError(f"components[{i}].weight", f"components[{i}].weight must be a finite number, "
                                                       f"got {weight!r}")
    if method in _DENSITY:
        density = params.get("density")
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise MergeError("parameters.density", f"method {method} needs parameters.density in (0, 1] (the "
                                                   f"fraction of entries kept), got {density!r}")
        params["density"] = float(density)
    if "majority_sign_method" in allowed:
        sign = params.setdefault("majority_sign_method", "total")
        if sign not in SIGN_METHODS:
            raise MergeError("parameters.majority_sign_method", f"parameters.majority_sign_method must be one of "
                                                                f"{', '.join(SIGN_METHODS)}, got {str(sign)[:40]!r}")
    if "seed" in allowed:
        seed = params.setdefault("seed", random.randrange(MAX_SEED))
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise MergeError("parameters.seed", f"parameters.seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    if "svd_rank" in params:
        rank = params["svd_rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise MergeError("parameters.svd_rank", f"parameters.svd_rank must be a positive integer, got {rank!r}")
    if "svd_clamp" in params:
        clamp = params["svd_clamp"]
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not 0 < clamp <= 1:
            raise MergeError("parameters.svd_clamp", f"parameters.svd_clamp is a quantile in (0, 1], got {clamp!r}")
        params["svd_clamp"] = float(clamp)
    return params


def _module_ranks(adapter: LoRAAdapter) -> dict[tuple[int, str], int]:
    return {key: a.shape[0] for key, (a, _) in adapter.weights.items()}


def _peft_rank(adapter: LoRAAdapter) -> int:
    """The rank PEFT sizes a merge by: r, or the largest rank_pattern rank when modules have their own."""
    return max(adapter.rank, *_module_ranks(adapter).values())


def merged_rank(method: str, params: Mapping, components: Sequence[MergeComponent]) -> int:
    """The rank of the merged adapter (PEFT's rule): cat the sum of the components' ranks, svd svd_rank or
    the largest, the others the common rank."""
    ranks = [_peft_rank(c.adapter) for c in components]
    if method == "cat":
        return sum(ranks)
    if method == "svd":
        return params.get("svd_rank") or max(ranks)
    return ranks[0]


def check_components(method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig,
                     max_rank: int | None = None) -> None:
    """The preconditions PEFT has for `method`, and what it cannot merge, checked on the loaded components;
    `max_rank`: the largest rank this server accepts for an adapter."""
    for i, c in enumerate(components):
        if any(target == "router" for _, target in c.adapter.weights):
            raise MergeError(f"components[{i}]", f"component {c.label} has LoRA on the router of a mixture-of-experts "
                                                 "base; merging router LoRA is not supported: merge adapters with LoRA "
                                                 "on the attention and dense projections only")
        if c.adapter.experts:
            raise MergeError(f"components[{i}]", f"component {c.label} has LoRA on routed experts; merging of expert "
                                                 "LoRA is not supported: merge adapters with LoRA on the attention and "
                                                 "dense projections only")
        what = {"DoRA (lora_magnitude_vector)": bool(c.adapter.magnitudes),
                "a LoRA on embed_tokens": c.adapter.embedding is not None,
                "trained heads or trainable tokens": bool(c.adapter.heads)}
        for feature, present in what.items():
            if present:
                raise MergeError(f"components[{i}]", f"component {c.label} has {feature}: merging it is not "
                                                     "supported (PEFT's add_weighted_adapter would drop or mis-merge "
                                                     "it); merge adapters with plain LoRA projections only")
    if method in _EQUAL_RANKS:
        ranks = {c.label: _peft_rank(c.adapter) for c in components}
        if len(set(ranks.values())) > 1:
            listed = ", ".join(f"{label} r={r}" for label, r in ranks.items())
            raise MergeError("components", f"method {method} combines A and B matrices entry by entry, so all "
                                           f"components need the same rank ({listed}); use cat or svd instead")
        common = next(iter(ranks.values()))
        for c in components:
            odd = sorted(key for key, r in _module_ranks(c.adapter).items() if r != common)
            if odd:
                layer, target = odd[0]
                raise MergeError("components", f"method {method} needs every module at the same rank, but "
                                               f"component {c.label} has rank {_module_ranks(c.adapter)[odd[0]]} on "
                                               f"layer {layer} {target} (rank_pattern); use cat or svd instead")
    rank = merged_rank(method, params, components)
    if method == "svd":
        shapes = checkpoint_shapes(base)
        smallest = min(min(shapes[t]) for c in components for t in _fused_keys(c.adapter, base).values())
        if rank > smallest:
            raise MergeError("parameters.svd_rank", f"svd_rank {rank} is larger than the smallest merged projection "
                                                    f"({smallest} wide); give parameters.svd_rank <= {smallest}")
    if max_rank is not None and rank > max_rank:
        hint = "give a smaller parameters.svd_rank" if method == "svd" else "merge fewer or smaller adapters"
        raise MergeError("parameters.svd_rank" if method == "svd" else "components",
                         f"the merged adapter would have rank {rank}, above this server's limit of {max_rank}; {hint}")


# ---------------------------------------------------------------------------------------------- memory

_F32 = 4
_FIXED_BYTES = 32 * 1024**2  # PEFT's model objects, the interpreter's heap growth, the frames


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _svd_workspace(m: int, n: int) -> int:
    """Elements torch.linalg.svd(full_matrices=False) holds for an m x n float32 matrix beside it: LAPACK's copy
    of the input, U (m x k) and Vh (k x n), S, and gesdd's work arrays (about 4k² + 8k), k = min(m, n)."""
    k = min(m, n)
    return m * n + k * (m + n) + 4 * k * k + 8 * k + max(m, n)


def peak_bytes(method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig
               ) -> tuple[int, str]:
    """(bytes, what dominates): an upper estimate of a merge's peak allocation. Every method holds the components'
    LoRA tensors three times (loaded, packed for the worker, in the PeftModel) and the result twice (tensors and
    file). Per module, one module at a time: svd PEFT's dense deltas, each component's d_out x d_in B·A, three
    copies of each in its weighted sum (the list, torch.stack, the weighted product) plus the sum, then the SVD's
    workspace beside the sum; the other methods a few copies of the module's LoRA tensors."""
    rank = merged_rank(method, params, components)
    shapes = checkpoint_shapes(base)
    lora = sum(c.adapter.nbytes for c in components)
    per_module: dict[tuple[int, str], list[int]] = {}  # (layer, base module) -> components' LoRA elements there
    for c in components:
        mine: dict[tuple[int, str], int] = {}
        for key, target in _fused_keys(c.adapter, base).items():  # Phi-3's parts count towards the fused module
            a, b = c.adapter.weights[key]
            mine[(key[0], target)] = mine.get((key[0], target), 0) + a.numel() + b.numel()
        for key, elements in mine.items():
            per_module.setdefault(key, []).append(elements)
    result = sum(rank * sum(shapes[target]) for _, target in per_module) * _F32
    worst, why = 0, "the components' LoRA tensors"
    for (layer, target), sizes in per_module.items():
        if method == "svd":
            d_in, d_out = shapes[target]
            dense = d_out * d_in
            need = max((3 * len(sizes) + 1) * dense, dense + _svd_workspace(d_out, d_in)) * _F32
            what = (f"layer {layer} {target}: {len(sizes)} components' dense {d_out} x {d_in} deltas, three copies "
                    "each in PEFT's weighted sum, then the SVD")
        else:
            need, what = 6 * sum(sizes) * _F32, f"layer {layer} {target}: its LoRA tensors"
        if need > worst:
            worst, why = need, what
    return 3 * lora + 2 * result + worst + _FIXED_BYTES, why


def check_memory(method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig,
                 memory_bytes: int) -> int:
    """Refuse (MergeTooLarge) a merge whose estimated peak (`peak_bytes`) is above `memory_bytes`, before anything
    is allocated for it; return the estimate."""
    need, why = peak_bytes(method, params, components, base)
    if need > memory_bytes:
        hint = "merge fewer components, use cat (exact, no dense deltas), " if method == "svd" else \
            "merge fewer or smaller components, "
        raise MergeTooLarge("components", f"the {method} merge would need about {_gib(need)} of memory at its peak "
                                          f"({why}), above this server's merge memory limit of {_gib(memory_bytes)} "
                                          f"(LORAMUX_MERGE_MEMORY_BYTES={memory_bytes}); {hint}or raise "
                                          "LORAMUX_MERGE_MEMORY_BYTES")
    return need


# ---------------------------------------------------------------------------------------------- merge

def _fused_keys(adapter: LoRAAdapter, base: ModelConfig) -> dict[tuple[int, str], str]:
    """{(layer, engine target): base module target} for the modules the adapter covers."""
    if not base.fused_projections:
        return {key: key[1] for key in adapter.weights}
    part_of = {part: fused for fused, parts in FUSED_TARGETS.items() for part in parts}
    return {key: part_of.get(key[1], key[1]) for key in adapter.weights}


def _checkpoint_weights(adapter: LoRAAdapter, base: ModelConfig
                        ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """{(layer, base module target): (A, B, scale)}: Phi-3's fused modules put back together (one A, the B
    row blocks stacked), as PEFT sees the adapter on the checkpoint's modules."""
    out = {}
    for layer, target in sorted(set((key[0], t) for key, t in _fused_keys(adapter, base).items())):
        keys = [(layer, part) for part in FUSED_TARGETS.get(target, (target,))]
        a = adapter.weights[keys[0]][0]
        b = torch.cat([adapter.weights[k][1] for k in keys], dim=0)
        out[(layer, target)] = (a, b, adapter.scale_of(keys[0]))
    return out


def _skeleton(base: ModelConfig) -> torch.nn.Module:
    """The base model's projections by their own names and shapes, in the model's order, each weight a zero
    scalar broadcast to its shape (no memory; see the module docstring for why not meta)."""
    zero = torch.zeros((), dtype=torch.float32)
    root, shapes = torch.nn.Module(), checkpoint_shapes(base)
    order = _hf_order(base)
    for (_, target), name in sorted(module_names(base).items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        d_in, d_out = shapes[target]
        linear = torch.nn.Linear(d_in, d_out, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(zero.expand(d_out, d_in), requires_grad=False)
        parent.add_module(leaf, linear)
    return root


def _hf_order(base: ModelConfig) -> tuple[str, ...]:
    """The order HF's model class defines a layer's projections in (see _PHI3_ORDER)."""
    if base.fused_projections:
        return _PHI3_ORDER
    order = base_targets(base)
    if "in_proj_qkv" in order:  # Qwen3.5
        order = tuple(t for t in order if t not in _QWEN3_5_LINEAR_ORDER)
        at = order.index("o_proj") + 1
        order = (*order[:at], *_QWEN3_5_LINEAR_ORDER, *order[at:])
    return order


def merge(method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig,
          limits: MergeLimits | None = None) -> MergedAdapter:
    """Merge checked components (see `check_request`, `check_components`) with PEFT's add_weighted_adapter on a
    skeleton PeftModel of `base`; return the merged adapter's files. Blocking: run it off the event loop.

    First `check_memory` against `limits.memory_bytes` (MergeTooLarge before anything is allocated). cat and
    linear then run here; ties, dare_* and svd in a worker process of the bounded pool for `limits` (MergeBusy
    when none frees within the timeout, MergeTooLarge when the worker passes its time or memory)."""
    limits = limits or MergeLimits()
    check_memory(method, params, components, base, limits.memory_bytes)
    if method not in WORKER_METHODS:
        return _merge_here(method, params, components, base)
    return merge_pool(limits).run(method, params, components, base)


def _merge_here(method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig
                ) -> MergedAdapter:
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    assert method in METHODS  # check_request refused any other

    names = module_names(base)
    model = None
    adapter_names = []
    for i, c in enumerate(components):
        weights = _checkpoint_weights(c.adapter, base)
        full = {key: names[key] for key in weights}
        # PEFT annotates lora_alpha as int, but takes any number (scaling = lora_alpha / r): alphas may be fractional.
        config = LoraConfig(r=c.adapter.rank, lora_alpha=c.adapter.alpha,  # pyright: ignore[reportArgumentType]
                            use_rslora=c.adapter.use_rslora,
                            target_modules=[full[key] for key in sorted(full)],
                            rank_pattern={re.escape(full[key]): a.shape[0] for key, (a, _, _) in weights.items()
                                          if a.shape[0] != c.adapter.rank},
                            lora_dropout=0.0)
        name = f"c{i}"
        if model is None:
            model = get_peft_model(_skeleton(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        modules = dict(model.get_base_model().named_modules())
        with torch.no_grad():
            for key, (a, b, scale) in weights.items():
                layer = modules[full[key]]
                assert isinstance(layer, LoraLayer)  # get_peft_model wrapped every targeted module
                layer.get_parameter(f"lora_A.{name}.weight").copy_(a)
                layer.get_parameter(f"lora_B.{name}.weight").copy_(b)
                layer.scaling[name] = scale  # the stored scale exactly (alpha / r would round again)
        adapter_names.append(name)
    assert model is not None
    kwargs = {"density": params.get("density"), "majority_sign_method": params.get("majority_sign_method", "total")}
    if method == "svd":  # a thin U (d_out x min(d_out, d_in)): PEFT's default would allocate d_out x d_out
        kwargs.update(svd_rank=params.get("svd_rank"), svd_clamp=params.get("svd_clamp"), svd_full_matrices=False)
    with torch.no_grad():
        if "seed" in params:  # in a worker process of its own (see the module docstring)
            torch.manual_seed(params["seed"])
        model.add_weighted_adapter(adapter_names, [float(c.weight) for c in components], MERGED,
                                   combination_type=method, **kwargs)
    return _peft_files(model, base)


def _peft_files(model, base: ModelConfig) -> MergedAdapter:
    """The merged adapter of `model` as PEFT's two files: target_modules a projection's short name where every
    layer has it, else the module names (always on a multimodal base, whose vision tower has modules of the same
    short names)."""
    from safetensors.torch import save

    config = model.peft_config[MERGED]
    modules = dict(model.base_model.model.named_modules())
    tensors, covered, names = {}, [], module_names(base)
    for (layer, target), name in names.items():
        module = modules[name]
        if not hasattr(module, "lora_A") or MERGED not in module.lora_A:
            continue
        covered.append((layer, target))
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = module.lora_A[MERGED].weight.detach().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = module.lora_B[MERGED].weight.detach().contiguous()
    targets = []
    for target in base_targets(base):
        layers = [layer for layer, t in covered if t == target]
        if len(layers) == base.num_layers and not base.multimodal:
            targets.append(target)
        else:
            targets += [names[(layer, target)] for layer in layers]
    body = {"peft_type": "LORA", "r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": None}
    return MergedAdapter(json.dumps(body).encode(), save(tensors), config.r)


# ---------------------------------------------------------------------------------------------- worker pool

_POOLS: dict[MergeLimits, MergePool] = {}
_POOLS_LOCK = threading.Lock()


def merge_pool(limits: MergeLimits) -> MergePool:
    """The process-wide pool for `limits` (one per distinct setting, so a changed setting takes effect)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(limits)
        if pool is None:
            pool = _POOLS[limits] = MergePool(limits)
        return pool


class MergePool:
    """At most `limits.workers` merges at once, each in a fresh `python -m loramux.adapters.composition.merge_worker`
    process (nothing of the serving process is forked or re-imported), bounded in memory (RLIMIT_AS, set by the
    worker after its imports) and wall time (killed here, past `limits.timeout_s` from its start; RLIMIT_CPU is a
    backstop; the worker also dies with its parent). `run` returns only once its worker is gone and reaped."""

    def __init__(self, limits: MergeLimits):
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.workers)
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.started: list[int] = []  # pids of the workers started (the last 64), for tests and diagnostics

    def live_pids(self) -> list[int]:
        """Workers running right now."""
        with self._lock:
            return sorted(self._live)

    def run(self, method: str, params: Mapping, components: Sequence[MergeComponent], base: ModelConfig
            ) -> MergedAdapter:
        from loramux.adapters.storage.blob import pack

        if not self._slots.acquire(timeout=self.limits.timeout_s):
            raise MergeBusy("method", f"every merge worker ({self.limits.workers}, LORAMUX_MERGE_WORKERS) stayed "
                                      f"busy for {self.limits.timeout_s:g} s (LORAMUX_MERGE_TIMEOUT_S); nothing "
                                      "ran, try again later")
        try:
            parts = []
            for c in components:  # checked plain LoRA (check_components): A, B and the modules' own scales
                a = c.adapter
                blob, digest = pack(a.rank, a.alpha, a.use_rslora, a.target_modules, a.weights, a.module_scales)
                parts.append((c.label, blob, digest, float(c.weight)))
            job = {"method": method, "params": dict(params), "components": parts, "base": base,
                   "memory_bytes": self.limits.memory_bytes, "cpu_s": self.limits.timeout_s}
            payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
            del parts, job
            return self._run(method, payload)
        finally:
            self._slots.release()

    def _run(self, method: str, payload: bytes) -> MergedAdapter:
        from loramux.engine.structured.compile_pool import kill_worker, read_frame, write_frame

        deadline = time.monotonic() + self.limits.timeout_s
        proc = subprocess.Popen(python_command("-m", "loramux.adapters.composition.merge_worker"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        with self._lock:
            self._live.add(proc.pid)
            self.started = [*self.started[-63:], proc.pid]
        # Written from a thread: a worker that stops reading must not block the deadline.
        writer = threading.Thread(target=_send, args=(proc, write_frame, payload), daemon=True,
                                  name="loramux-merge-send")
        assert proc.stdout is not None  # a pipe (stdout=PIPE)
        writer.start()
        try:
            try:
                kind, body = read_frame(proc.stdout.fileno(), deadline, self.limits.memory_bytes + 2**30)
            except TimeoutError:
                raise self._timed_out(method) from None
            except Exception:  # noqa: BLE001 - the worker died (EOF) or wrote garbage: say why from its exit
                kill_worker(proc)
                if proc.returncode == -signal.SIGXCPU:  # the RLIMIT_CPU backstop
                    raise self._timed_out(method) from None
                if proc.returncode == -signal.SIGKILL:  # the kernel's OOM killer
                    raise self._out_of_memory(method, "it was killed for memory") from None
                raise RuntimeError(f"the {method} merge's worker process failed (exit {proc.returncode})") from None
        finally:
            kill_worker(proc)
            writer.join()
            with self._lock:
                self._live.discard(proc.pid)
        if kind == b"O":
            config, weights, rank = pickle.loads(body)
            return MergedAdapter(config, weights, rank)
        if kind == b"X":
            raise self._out_of_memory(method, body.decode(errors="replace")[:300])
        raise pickle.loads(body)  # E: the merge's own exception (PEFT's, a MergeError), re-raised here

    def _timed_out(self, method: str) -> MergeTooLarge:
        return MergeTooLarge("components", f"the {method} merge ran longer than this server's merge time limit of "
                                           f"{self.limits.timeout_s:g} s (LORAMUX_MERGE_TIMEOUT_S) and was stopped; "
                                           "nothing was stored. Merge fewer or smaller components, or raise "
                                           "LORAMUX_MERGE_TIMEOUT_S")

    def _out_of_memory(self, method: str, detail: str) -> MergeTooLarge:
        return MergeTooLarge("components", f"the {method} merge ran out of its memory limit of "
                                           f"{_gib(self.limits.memory_bytes)} (LORAMUX_MERGE_MEMORY_BYTES="
                                           f"{self.limits.memory_bytes}) and was stopped ({detail}); nothing was "
                                           "stored. Merge fewer components, or raise LORAMUX_MERGE_MEMORY_BYTES")


def _send(proc: subprocess.Popen, write_frame, payload: bytes) -> None:
    assert proc.stdin is not None  # a pipe (stdin=PIPE)
    try:
        write_frame(proc.stdin, b"J", payload)
        proc.stdin.close()
    except (OSError, ValueError):  # the worker is gone (killed on timeout): nothing to send to
        pass
