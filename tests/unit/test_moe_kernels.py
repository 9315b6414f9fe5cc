"""Grouped mixture-of-experts ops: routing pairs grouped by expert, the grouped expert matmul and the per-(slot,
expert) LoRA delta, torch and Triton (interpreter) paths against a float64 reference."""
from __future__ import annotations

import pytest
import torch

from loramux.kernels import moe
from loramux.kernels.moe import (
    dense_expert_matmul,
    expert_lora,
    group_by_expert,
    grouped_matmul,
    pick_lora_strategy,
    plan_expert_lora,
    virtual_slots,
)
from loramux.kernels.ops import triton_available

TRITON = pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="triton is not installed"))
IMPLS = ["torch", TRITON]


def test_group_by_expert_sorts_pairs_stably_by_expert():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [0, 2]])  # flat pairs: 2 0 0 3 2 1 0 2; expert 4 unused
    groups = group_by_expert(ids, num_experts=5)
    assert groups.order.tolist() == [1, 2, 6, 5, 0, 4, 7, 3]
    assert groups.tokens.tolist() == [0, 1, 3, 2, 0, 2, 3, 1]
    assert groups.experts.tolist() == [0, 0, 0, 1, 2, 2, 2, 3]
    assert (groups.present, groups.counts, groups.offsets) == ([0, 1, 2, 3], [3, 1, 3, 1], [0, 3, 4, 7, 8])
    assert groups.num_experts == 5 and groups.num_pairs == 8 and groups.max_count == 3


def test_group_by_expert_breaks_ties_by_row_slot():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [0, 2]])
    groups = group_by_expert(ids, num_experts=5, row_slot=torch.tensor([1, -1, 0, 1]))
    # expert 0: pairs 1 (slot 1), 2 (-1), 6 (1) -> 2, 1, 6; expert 2: pairs 0 (1), 4 (0), 7 (1) -> 4, 0, 7
    assert groups.order.tolist() == [2, 1, 6, 5, 4, 0, 7, 3]
    assert groups.tokens.tolist() == [1, 0, 3, 2, 2, 0, 3, 1]
    assert (groups.present, groups.counts, groups.offsets) == ([0, 1, 2, 3], [3, 1, 3, 1], [0, 3, 4, 7, 8])
    assert virtual_slots(groups, torch.tensor([1, -1, 0, 1])).tolist() == [-1, 5, 5, 1, 2, 7, 7, -1]


@pytest.mark.parametrize("with_slots", [False, True])
def test_group_by_expert_matches_a_python_sort(with_slots):
    g = torch.Generator().manual_seed(1)
    T, k, E, S = 40, 3, 12, 3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[ids == 7] = 5  # expert 7 is never picked; some rows pick 5 twice (no harm: just two pairs)
    row_slot = torch.randint(-1, S, (T,), generator=g) if with_slots else None
    groups = group_by_expert(ids, E, row_slot)
    flat = ids.view(-1).tolist()
    slot_of = (lambda p: row_slot[p // k].item()) if with_slots else (lambda p: 0)
    assert groups.order.tolist() == sorted(range(T * k), key=lambda p: (flat[p], slot_of(p), p))
    assert groups.tokens.tolist() == [p // k for p in groups.order.tolist()]
    assert groups.experts.tolist() == [flat[p] for p in groups.order.tolist()]
    assert groups.present == sorted(set(flat)) and 7 not in groups.present
    assert groups.counts == [flat.count(e) for e in groups.present]
    for e, lo, hi in zip(groups.present, groups.offsets, groups.offsets[1:]):
        assert set(groups.experts[lo:hi].tolist()) == {e}
    if with_slots:  # each (expert, slot) is one run, so each virtual slot is one run
        v = virtual_slots(groups, row_slot).tolist()
        runs = [v[i] for i in range(len(v)) if v[i] >= 0 and (i == 0 or v[i] != v[i - 1])]
        assert len(runs) == len(set(runs))
        assert plan_expert_lora(torch.tensor(v)).order is None


def test_group_by_expert_rejects_bad_ids():
    with pytest.raises(ValueError, match="must be < num_experts"):
        group_by_expert(torch.tensor([[0, 4]]), num_experts=4)
    with pytest.raises(ValueError, match=r"\[tokens, k\]"):
        group_by_expert(torch.tensor([0, 1]), num_experts=4)


def _grouped_reference(x, w, groups, bias):
    e = groups.experts
    out = torch.einsum("pi,pio->po", x.double(), w.double()[e])
    return out if bias is None else out + bias.double()[e]


def _weights(g, E, d_in, d_out, layout):
    if layout == "transposed":  # an [E, d_out, d_in] stack (nn.Linear's layout) seen as [E, d_in, d_out]
        return torch.randn(E, d_out, d_in, generator=g).transpose(1, 2)
    return torch.randn(E, d_in, d_out, generator=g)


GROUPED_CASES = {
    "mixed": (9, 2, 5, None),  # (tokens, k, experts, a forced expert for every pair)
    "one_expert": (70, 1, 4, 2),  # one run longer than a 64-row tile
    "one_token": (1, 3, 6, None),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_matmul_matches_float64_reference(impl, with_bias, layout, case):
    T, k, E, only = GROUPED_CASES[case]
    g = torch.Generator().manual_seed(T * 10 + k)
    d_in, d_out = 24, 72  # no multiples of the kernel's 64-wide tiles
    ids = torch.full((T, k), only) if only is not None else torch.stack(
        [torch.randperm(E, generator=g)[:k] for _ in range(T)])
    groups = group_by_expert(ids, E)
    x = torch.randn(T, d_in, generator=g).index_select(0, groups.tokens)
    w = _weights(g, E, d_in, d_out, layout)
    bias = torch.randn(E, d_out, generator=g) if with_bias else None
    out = grouped_matmul(x, w, groups, bias, impl=impl)
    assert out.shape == (T * k, d_out)
    torch.testing.assert_close(out.double(), _grouped_reference(x, w, groups, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_never_reads_an_unpicked_expert(impl, monkeypatch):
    """No dense work: experts no pair picks hold NaN weights and biases, and the output stays finite; the torch
    path makes one GEMM per present expert whose multiply-adds add up to the pairs' own."""
    g = torch.Generator().manual_seed(3)
    E, d_in, d_out = 8, 16, 20
    ids = torch.tensor([[1, 6], [6, 3], [1, 3]])
    groups = group_by_expert(ids, E)
    w = _weights(g, E, d_in, d_out, "transposed")
    bias = torch.randn(E, d_out, generator=g)
    absent = [e for e in range(E) if e not in groups.present]
    w[absent] = float("nan")
    bias[absent] = float("nan")
    x = torch.randn(3, d_in, generator=g).index_select(0, groups.tokens)
    macs = []
    if impl == "torch":
        real_addmm = torch.addmm

        def counting_addmm(bias_row, a, b, **kwargs):
            macs.append(a.shape[0] * a.shape[1] * b.shape[1])
            return real_addmm(bias_row, a, b, **kwargs)

        monkeypatch.setattr(torch, "addmm", counting_addmm)
    out = grouped_matmul(x, w, groups, bias, impl=impl)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _grouped_reference(x, w, groups, bias), atol=1e-4, rtol=1e-4)
    if impl == "torch":
        assert len(macs) == len(groups.present) == 3 and sum(macs) == 6 * d_in * d_out


def test_dense_expert_matmul_computes_every_expert():
    g = torch.Generator().manual_seed(4)
    x, w, bias = torch.randn(5, 6, generator=g), torch.randn(3, 6, 7, generator=g), torch.randn(3, 7, generator=g)
    out = dense_expert_matmul(x, w, bias)
    expected = torch.stack([x.double() @ w[e].double() + bias[e].double() for e in range(3)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense_expert_matmul(x, w).double(), expected - bias.double()[:, None], atol=1e-5,
                               rtol=1e-5)


def _lora_reference(y, x, a, b, scale, vslots):
    out = y.double().clone()
    live = vslots >= 0
    v = vslots[live]
    t = torch.einsum("pi,pri->pr", x.double()[live], a.double()[v])
    out[live] += torch.einsum("pr,por->po", t, b.double()[v]) * scale.double()[v, None]
    return out


LORA_VSLOTS = {
    "grouped": [-1, 5, 5, 6, 2, 7, 7, 7, -1, 0],  # one run per v, as group_by_expert with row_slot leaves them
    "scattered": [3, -1, 3, 0, 7, 3, -1, 0, 0, 5],  # v 3 and 0 in several runs: sorted and gathered
    "all_live": [1, 1, 4, 2, 2, 2, 6, 0, 3, 3],
    "decode": [6, 1, 4, 0, 7, 2, -1, 5, 3, -1],  # one row per v
    "none_live": [-1] * 10,
}


@pytest.mark.parametrize("impl", ["torch-gather", "torch-segments", "torch", TRITON])
@pytest.mark.parametrize("case", list(LORA_VSLOTS))
def test_expert_lora_matches_float64_reference(impl, case):
    g = torch.Generator().manual_seed(len(case))
    V, R, d_in, d_out = 8, 3, 20, 36  # a rank that is no power of two
    vslots = torch.tensor(LORA_VSLOTS[case])
    N = vslots.shape[0]
    # The slot pool's CPU layout: A stored [V, d_in, R], B [V, R, d_out], both handed over transposed.
    a = (torch.randn(V, d_in, R, generator=g) / d_in**0.5).transpose(1, 2)
    b = torch.randn(V, R, d_out, generator=g).transpose(1, 2)
    if case == "all_live":  # and contiguous stacks once
        a, b = a.contiguous(), b.contiguous()
    scale = torch.rand(V, generator=g) + 0.5
    x = torch.randn(N, d_in, generator=g)
    y = torch.randn(N, d_out, generator=g)
    before = y.clone()
    expected = _lora_reference(y, x, a, b, scale, vslots)
    kind, _, strategy = impl.partition("-")
    expert_lora(y, x, a, b, scale, vslots, impl=kind, plan=plan_expert_lora(vslots, strategy or None))
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    dead = vslots < 0
    assert torch.equal(y[dead], before[dead]), "rows without an adapter must be left untouched"


@pytest.mark.parametrize("strategy", ["gather", "segments"])
def test_expert_lora_strategies_are_taken(strategy, monkeypatch):
    """Each forced strategy runs its own code (so the reference test above checks both), and a plan built once
    serves two ops on the same pairs (a layer's gate_up and down)."""
    taken = []
    for name in ("_lora_gather", "_lora_segments"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *args, _real=real, _name=name: (taken.append(_name), _real(*args)))
    g = torch.Generator().manual_seed(9)
    vslots = torch.tensor([2, 2, -1, 0, 1, 1])
    plan = plan_expert_lora(vslots, strategy)
    for d_in, d_out in [(8, 12), (12, 8)]:
        a, b = torch.randn(3, 4, d_in, generator=g), torch.randn(3, d_out, 4, generator=g)
        x, y, scale = torch.randn(6, d_in, generator=g), torch.randn(6, d_out, generator=g), torch.rand(3)
        expected = _lora_reference(y, x, a, b, scale, vslots)
        expert_lora(y, x, a, b, scale, vslots, impl="torch", plan=plan)
        torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    assert taken == [f"_lora_{strategy}"] * 2


def test_lora_strategy_rule():
    kib = 1024
    assert pick_lora_strategy(64, 64, 64 * kib) == "gather"  # decode, small matrices: copying them is cheap
    assert pick_lora_strategy(64, 60, 224 * kib) == "segments"  # decode, a 2048 -> 1536 projection at rank 16
    assert pick_lora_strategy(512, 128, 16 * kib) == "gather"  # 4 rows per v of 16 KiB matrices
    assert pick_lora_strategy(2048, 128, 16 * kib) == "segments"  # prefill: 16 rows per v


def test_expert_lora_rejects_a_virtual_slot_out_of_range():
    a, b = torch.zeros(4, 2, 3), torch.zeros(4, 5, 2)
    with pytest.raises(ValueError, match="out of range"):
        expert_lora(torch.zeros(2, 5), torch.zeros(2, 3), a, b, torch.ones(4), torch.tensor([0, 4]), impl="torch")
    with pytest.raises(ValueError, match=">= -1"):
        expert_lora(torch.zeros(2, 5), torch.zeros(2, 3), a, b, torch.ones(4), torch.tensor([0, -2]), impl="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_packed_matmul_equals_grouped_matmul(dtype):
    """The oneDNN-packed experts (CPU) give grouped_matmul's result: each pair through its own expert, bias too."""
    from loramux.kernels.moe import grouped_packed_matmul
    from loramux.model import cpu_linear

    g = torch.Generator().manual_seed(3)
    num_experts, d_in, d_out = 6, 48, 40
    if not cpu_linear.can_pack(d_in, d_out, dtype, 8):
        pytest.skip("oneDNN packing unavailable here")
    w = torch.randn(num_experts, d_out, d_in, generator=g).to(dtype)
    bias = torch.randn(num_experts, d_out, generator=g).to(dtype)
    groups = group_by_expert(torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0]]), num_experts)
    x = torch.randn(groups.num_pairs, d_in, generator=g).to(dtype)
    packed = [cpu_linear.pack(w[e].t(), 8) for e in range(num_experts)]
    for b in (None, bias):
        want = grouped_matmul(x, w.transpose(1, 2), groups, b, impl="torch")
        got = grouped_packed_matmul(x, packed, d_out, groups, b)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
