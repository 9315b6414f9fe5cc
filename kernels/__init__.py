"""Segmented-gather LoRA ops (SGMV): Triton on GPU, torch on CPU, behind one dispatch.

    lora_shrink: v[t] = x[t] @ A[slot[t]]^T
    lora_expand: y[t, off:off+d_out] += (v[t] @ B[slot[t]]^T) * scale[slot[t]]

Rows whose slot is -1 are left untouched. Layers never call these directly: they go through
`LoRAWrapper` (loramux.kernels.wrapper).
"""
from loramux.kernels.ops import LoRABatch, lora_expand, lora_shrink
from loramux.kernels.segments import NO_ADAPTER, Groups, Segments, build_groups, build_segments

__all__ = ["Groups", "LoRABatch", "NO_ADAPTER", "Segments", "build_groups", "build_segments", "lora_expand",
           "lora_shrink"]
