"""A composite that is finite in float32 but overflows a float16 device pool is refused, naming the module:
MAX_WEIGHT alone cannot bound w * scale * A for float16."""
from __future__ import annotations

import pytest
import torch

from loramux.adapters.composition.weighted import CompositionError, compose
from loramux.adapters.formats.dtype_range import check_fits, first_out_of_range
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.formats.validation import projection_shapes
from loramux.adapters.residency.device_pool import DevicePool
from loramux.model.llama import PROJECTION_SLICES
from loramux.model.loader import build_model
from loramux.server.intake.composition import MAX_WEIGHT

RANK = 2


def _adapter(cfg, name: str, a_value: float, alpha: float = RANK) -> LoRAAdapter:
    d_in, d_out = projection_shapes(cfg)["q_proj"]
    a = torch.full((RANK, d_in), a_value)
    b = torch.full((d_out, RANK), 0.01)
    return LoRAAdapter(name=name, rank=RANK, alpha=alpha, use_rslora=False, target_modules=("q_proj",),
                       weights={(0, "q_proj"): (a, b)}, digest=name * 8)


@pytest.fixture(scope="module")
def fp16_model(tiny_dir):
    return build_model(tiny_dir, torch.float16, torch.device("cpu"))


def test_a_weight_within_max_weight_overflows_a_float16_pool_and_is_refused(fp16_model):
    model, cfg = fp16_model
    composite = compose([(_adapter(cfg, "big", 100.0), MAX_WEIGHT)], "c")  # A rows of 1e5: finite in float32
    assert torch.isfinite(composite.weights[(0, "q_proj")][0]).all()

    pool = DevicePool(model, 1 << 24, torch.float16, "cpu", "torch", async_loads=False)
    key = pool.bucket_of(composite)
    pool.resize(key, 1, [])
    pool.load(key, lambda: 0, composite).result()
    held = pool.buckets[key].weights[(0, PROJECTION_SLICES["q_proj"][0])].a[0]
    assert torch.isinf(held).any()  # what serving it would run on: every token from NaN

    assert first_out_of_range(composite.weights, torch.float16)[:2] == ((0, "q_proj"), "A")
    with pytest.raises(CompositionError, match=r"float16 adapter pool: the weighted A of layer 0 q_proj reaches "
                                               r"1e\+05, above 65504; lower the weights"):
        check_fits(composite, torch.float16)
    check_fits(composite, torch.float32)  # the same composite fits the wider pools
    check_fits(composite, torch.bfloat16)


def test_the_float16_bound_holds_up_to_its_largest_value_and_catches_non_finite(fp16_model):
    _, cfg = fp16_model
    fits = compose([(_adapter(cfg, "ok", 65.0), MAX_WEIGHT)], "ok")  # 65000 <= 65504
    check_fits(fits, torch.float16)
    scaled = compose([(_adapter(cfg, "alpha", 1.0, alpha=2 * RANK * 40), MAX_WEIGHT)], "s")  # scale 80: 8e4
    with pytest.raises(CompositionError, match="lower the weights"):
        check_fits(scaled, torch.float16)
    broken = _adapter(cfg, "nan", float("nan"))
    assert first_out_of_range(broken.weights, torch.float32)[1] == "A"
