"""The device-side slot buffers: one `LoRALayerWeights` per merged projection of every layer."""
from __future__ import annotations

import torch

from loramux.adapters.peft_format import LoRAAdapter
from loramux.kernels.wrapper import LoRALayerWeights, LoRAWrapper
from loramux.model.llama import LlamaModel, MergedLinear

# HF / PEFT projection name -> (merged module path in a decoder layer, slice name)
SLICE_OF = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"),
}
MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _a_buffer(num_slots: int, rows: int, d_in: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros for A as the kernels see it, [slots, rows, d_in]. On CPU it lives as [d_in, slots, rows] so
    that slots 0..k form one [d_in, k*rows] GEMM operand in the layout CPU BLAS reads fastest at small
    batch (see MergedLinear); on GPU it lives as is (contiguous rows for the Triton tiles)."""
    if device.type == "cpu":
        return torch.zeros(d_in, num_slots, rows, dtype=dtype, device=device).permute(1, 2, 0)
    return torch.zeros(num_slots, rows, d_in, dtype=dtype, device=device)


class DeviceSlotPool:
    """Allocates `num_slots` x `max_rank` buffers for every LoRA-able projection and wires them into
    the model, so each MergedLinear calls the shared LoRAWrapper with its own buffers."""

    def __init__(self, model: LlamaModel, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, lora_impl: str = "auto"):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.wrapper = LoRAWrapper(lora_impl, device)
        self.layers: list[dict[str, LoRALayerWeights]] = []
        # One scale per slot (alpha / r), shared by every projection.
        self.scale = torch.zeros(num_slots, dtype=torch.float32, device=device)
        for layer in model.layers:
            per_module = {}
            for path in MODULES:
                module: MergedLinear = layer.get_submodule(path)
                n = len(module.slices)
                weights = LoRALayerWeights(
                    a=_a_buffer(num_slots, n * max_rank, module.in_features, dtype, torch.device(device)),
                    # B lives as [slots, R, d_out] (so slots 0..k stack into one GEMM operand without a copy)
                    # and is handed to the kernels as the [slots, d_out, R] view their semantics name.
                    b=[torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device).transpose(1, 2)
                       for _, size in module.slices],
                    offsets=[module.slice_range(name)[0] for name, _ in module.slices],
                    scale=self.scale,
                    names=[name for name, _ in module.slices],
                )
                module.lora_wrapper, module.lora = self.wrapper, weights
                per_module[path] = weights
            self.layers.append(per_module)

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + sum(b.numel() * b.element_size() for b in w.b)
                   for layer in self.layers for w in layer.values())

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`, zeroing whatever the previous occupant left there."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > slot max rank {self.max_rank}")
        r, big = adapter.rank, self.max_rank
        for per_module in self.layers:
            for weights in per_module.values():
                weights.a[slot].zero_()
                for b in weights.b:
                    b[slot].zero_()
        self.scale[slot] = adapter.scale
        for (layer, target), (a, b) in adapter.weights.items():
            path, slice_name = SLICE_OF[target]
            weights = self.layers[layer][path]
            index = weights.names.index(slice_name)
            weights.a[slot, index * big:index * big + r].copy_(a)
            weights.b[index][slot, :, :r].copy_(b)

