"""Segmented-gather LoRA ops (SGMV): Triton on GPU, torch on CPU, behind one dispatch.

    lora_shrink: v[t] = x[t] @ A[slot[t]]^T
    lora_expand: y[t, off:off+d_out] += (v[t] @ B[slot[t]]^T) * scale[slot[t]]

Rows whose slot is -1 are left untouched. Layers never call these directly: they go through
`LoRAWrapper` (loramux.kernels.wrapper).
"""


def _hand_over_to_installed_kernels() -> None:
    """Imported as top-level `kernels`, this folder stands in for Hugging Face's `kernels` package (a
    dependency of transformers, which imports it at start). That happens whenever the repo root is on sys.path:
    `python -m`/`-c` run in a checkout, and processes that inherit a driver's working directory (Ray workers).
    Load the `kernels` that sys.path would find without this checkout into sys.modules["kernels"]: the import
    system returns whatever that entry holds once this module has run, so `import kernels` gets the real one.
    Fixing it here covers every such entry point; stripping the root from sys.path in each entry module would
    not (and would change what those processes can import)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    checkout = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    elsewhere = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # before it runs: its own `from kernels._internals import ...` resolve to it
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_installed_kernels()
else:
    from loramux.kernels.ops import LoRABatch, lora_expand, lora_shrink
    from loramux.kernels.segments import NO_ADAPTER, Groups, Segments, build_groups, build_segments

__all__ = ["Groups", "LoRABatch", "NO_ADAPTER", "Segments", "build_groups", "build_segments", "lora_expand",
           "lora_shrink"]
