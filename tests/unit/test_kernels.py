"""LoRA kernels: segment building, and the Triton (interpreter) and torch paths vs a float64 reference."""
from __future__ import annotations

import random

import pytest
import torch

from loramux.kernels import LoRABatch, build_groups, build_segments, lora_expand, lora_shrink, torch_ops
from loramux.kernels.torch_ops import lora_expand_reference, lora_shrink_reference


@pytest.mark.parametrize("slot_map,starts,lengths,slots", [
    ([], (), (), ()),
    ([-1, -1, -1], (), (), ()),
    ([0], (0,), (1,), (0,)),
    ([2, 2, 2], (0,), (3,), (2,)),
    ([0, 0, 1, 1, 1, -1, 0], (0, 2, 6), (2, 3, 1), (0, 1, 0)),
    ([-1, 3, -1, 3, 3], (1, 3), (1, 2), (3, 3)),
    ([1, 0, 1, 0], (0, 1, 2, 3), (1, 1, 1, 1), (1, 0, 1, 0)),
])
def test_build_segments(slot_map, starts, lengths, slots):
    seg = build_segments(slot_map)
    assert (seg.starts, seg.lengths, seg.slots) == (starts, lengths, slots)
    assert seg.num_tokens == len(slot_map)
    assert seg.max_length == max(lengths, default=0)
    assert seg.active_slots == tuple(dict.fromkeys(slots))
    assert seg.has_lora == bool(slots)


@pytest.mark.parametrize("slot_map,slots,rows,offsets,max_count,span", [
    ([], (), (), (0,), 0, None),
    ([-1, -1], (), (), (0,), 0, None),
    ([0, 1, 2, 3], (0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3, 4), 1, (0, 4)),  # decode, one adapter a row
    ([-1, 0, 0, 2, 2], (0, 2), (1, 2, 3, 4), (0, 2, 4), 2, (1, 5)),
    ([1, 0, 1, 0], (0, 1), (1, 3, 0, 2), (0, 2, 4), 2, None),  # not in slot order: a gather
    ([5, 5, 5, -1, 2], (2, 5), (4, 0, 1, 2), (0, 1, 4), 3, None),
    ([0, 0, 0, 1], (0, 1), (0, 1, 2, 3), (0, 3, 4), 3, None),  # contiguous but uneven: padded
])
def test_build_groups(slot_map, slots, rows, offsets, max_count, span):
    groups = build_groups(slot_map)
    assert (groups.slots, groups.rows, groups.offsets, groups.max_count, groups.span) == (
        slots, rows, offsets, max_count, span)
    padded = groups.padded_rows()
    assert len(padded) == len(slots) * max_count
    for g, slot in enumerate(slots):  # each group's rows first, then repeats of its first row
        block = padded[g * max_count:(g + 1) * max_count]
        own = [r for r in range(len(slot_map)) if slot_map[r] == slot]
        assert block[:len(own)] == own and set(block[len(own):]) <= {own[0]}


def test_build_groups_rejects_bad_slots():
    with pytest.raises(ValueError, match="slot ids must be >= -1"):
        build_groups([1, -3])


def test_skewed_steps_use_grouped_gemms_and_decode_batches_need_no_gather():
    decode = LoRABatch.from_slot_map([-1, 0, 1, 2, 3]).rows
    assert decode.strategy == "bmm" and decode.pad_index is None and decode.slot_range == (0, 4)
    skewed = LoRABatch.from_slot_map([0] * 300 + [1, 2, 3]).rows  # a long prefill beside three decodes
    assert skewed.strategy == ("grouped" if torch_ops.grouped_mm_available() else "bmm")
    scattered = LoRABatch.from_slot_map([4, 0, 4, 0]).rows  # slots 0 and 4: the stacks are gathered
    assert scattered.slot_range is None and scattered.slot_index.tolist() == [0, 4]


def test_unaligned_grouped_operands_fall_back_to_per_group_gemms(monkeypatch):
    """grouped_mm needs 16-byte strides: a rank-3 slice of the stacked shrink output is not; same result."""
    from loramux.kernels.ops import lora_shrink_expand

    monkeypatch.setattr(torch_ops, "pick_strategy", lambda groups: "grouped")
    g = torch.Generator().manual_seed(5)
    rank, d_in, outs, slot_map = 3, 10, [6, 5], [1, 1, 1, 0, -1, 1]
    x = torch.randn(len(slot_map), d_in, generator=g)
    a = torch.randn(2, len(outs) * rank, d_in, generator=g)
    bs = [torch.randn(2, o, rank, generator=g) for o in outs]
    scale = torch.tensor([0.5, 2.0])
    y = torch.randn(len(slot_map), sum(outs), generator=g)
    sm = torch.tensor(slot_map)
    expected = y.double().clone()
    for i, (b, off) in enumerate(zip(bs, [0, 6])):
        expected = lora_expand_reference(expected, lora_shrink_reference(x, a[:, i * rank:(i + 1) * rank], sm), b,
                                         scale, sm, off)
    lora_shrink_expand(y, x, a, bs, [0, 6], scale, LoRABatch.from_slot_map(slot_map), impl="torch")
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


def test_build_segments_rejects_bad_slots():
    with pytest.raises(ValueError, match="slot ids must be >= -1"):
        build_segments([0, -2])


def random_case(seed: int, num_tokens: int, layout: str, n_slots: int = 4):
    rng = random.Random(seed)
    if layout == "all_base":
        slot_map = [-1] * num_tokens
    elif layout == "one_adapter":
        slot_map = [rng.randrange(n_slots)] * num_tokens
    elif layout == "per_token_all":
        slot_map = [rng.randrange(n_slots) for _ in range(num_tokens)]
    elif layout == "per_token":
        slot_map = [rng.randrange(-1, n_slots) for _ in range(num_tokens)]
    else:  # runs of random length, some base-only, some slots never used (empty segments)
        slot_map = []
        while len(slot_map) < num_tokens:
            slot_map += [rng.choice([-1, 0, 2])] * rng.randint(1, 40)
        slot_map = slot_map[:num_tokens]
    return slot_map


CASES = [
    (1, 8, 16, 32, "per_token"),      # a single token
    (7, 64, 8, 96, "per_token"),
    (40, 48, 4, 80, "runs"),
    (100, 130, 16, 200, "runs"),      # larger than any kernel block (16 rows, 64 columns)
    (33, 64, 64, 64, "one_adapter"),
    (20, 32, 8, 48, "all_base"),
    (70, 96, 24, 150, "runs"),         # a rank that is no power of two
    (12, 40, 8, 24, "per_token_all"),
]


@pytest.mark.parametrize("impl", ["torch", "torch-bmm", "torch-grouped", "triton"])
@pytest.mark.parametrize("num_tokens,d_in,rank,d_out,layout", CASES)
def test_ops_match_float64_reference(impl, num_tokens, d_in, rank, d_out, layout, monkeypatch):
    if impl.startswith("torch-"):
        monkeypatch.setattr(torch_ops, "pick_strategy", lambda seg, forced=impl[6:]: forced)
    g = torch.Generator().manual_seed(num_tokens * 1000 + rank)
    n_slots = 4
    x = torch.randn(num_tokens, d_in, generator=g)
    # Alternate between a contiguous A and the slot pool's CPU layout ([slots, d_in, R] seen transposed).
    if num_tokens % 2:
        a = torch.randn(n_slots, rank, d_in, generator=g) / d_in**0.5
    else:
        a = (torch.randn(n_slots, d_in, rank, generator=g) / d_in**0.5).transpose(1, 2)
    # The slot pool's layout: B stored as [slots, R, d_out] and handed over transposed (a strided view).
    b = torch.randn(n_slots, rank, d_out, generator=g).transpose(1, 2)
    scale = torch.tensor([0.5, 2.0, 1.0, 0.25])
    col_offset = 5
    y = torch.randn(num_tokens, d_out + 9, generator=g)
    slot_map = random_case(num_tokens, num_tokens, layout, n_slots)
    batch = LoRABatch.from_slot_map(slot_map)
    sm = torch.tensor(slot_map, dtype=torch.long)

    kind = "triton" if impl == "triton" else "torch"
    v = lora_shrink(x, a, batch, impl=kind)
    torch.testing.assert_close(v.double(), lora_shrink_reference(x, a, sm), atol=1e-4, rtol=1e-4)
    expected = lora_expand_reference(y, v, b, scale, sm, col_offset)
    before = y.clone()
    lora_expand(y, v, b, scale, batch, col_offset=col_offset, impl=kind)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    base_rows = sm < 0
    assert torch.equal(y[base_rows], before[base_rows]), "rows without an adapter must be left untouched"
    assert torch.equal(y[:, :col_offset], before[:, :col_offset]), "columns outside the slice were written"


def test_bfloat16_torch_path_close_to_reference():
    # Triton's CPU interpreter has no bfloat16 (numpy); bench/gpu_check.py checks Triton in bf16 on a GPU.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 64, generator=g).bfloat16()
    a = (torch.randn(2, 16, 64, generator=g) / 8).bfloat16()
    b = torch.randn(2, 96, 16, generator=g).bfloat16()
    scale = torch.tensor([1.0, 0.5])
    batch = LoRABatch.from_slot_map([0] * 7 + [-1] * 3 + [1] * 10)
    v = lora_shrink(x, a, batch, impl="torch")
    ref_v = lora_shrink_reference(x, a, batch.slot_map)
    assert (v.double() - ref_v).abs().max() < 0.05
    y = torch.zeros(20, 96, dtype=torch.bfloat16)
    lora_expand(y, v, b, scale, batch, impl="torch")
    ref_y = lora_expand_reference(torch.zeros(20, 96), v, b, scale, batch.slot_map)
    assert (y.double() - ref_y).abs().max() < 0.1


@pytest.mark.parametrize("strategy", ["bmm", "grouped"])
@pytest.mark.parametrize("slot_map", [[0, 1, 2, 3, 1, -1, 2, 0], [3] * 5 + [-1] * 2, [2, -1, 0], [0, 0, 1, 1, 2, 2],
                                      [1] * 9 + [0, 3]])
def test_stacked_slices_match_per_slice_reference(strategy, slot_map, monkeypatch):
    from loramux.kernels.ops import lora_shrink_expand

    monkeypatch.setattr(torch_ops, "pick_strategy", lambda seg: strategy)
    g = torch.Generator().manual_seed(len(slot_map))
    n_slots, rank, d_in, outs = 4, 8, 24, [16, 8, 8]
    x = torch.randn(len(slot_map), d_in, generator=g)
    a = torch.randn(n_slots, len(outs) * rank, d_in, generator=g)
    bs = [torch.randn(n_slots, rank, o, generator=g).transpose(1, 2) for o in outs]
    offsets = [0, 16, 24]
    scale = torch.tensor([1.0, 0.5, 2.0, 0.25])
    y = torch.randn(len(slot_map), sum(outs), generator=g)
    sm = torch.tensor(slot_map)
    expected = y.double().clone()
    for i, (b, off) in enumerate(zip(bs, offsets)):
        v_i = lora_shrink_reference(x, a[:, i * rank:(i + 1) * rank], sm)
        expected = lora_expand_reference(expected, v_i, b, scale, sm, off)
    lora_shrink_expand(y, x, a, bs, offsets, scale, LoRABatch.from_slot_map(slot_map), impl="torch")
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


def _stacked_reference(y, x, a, bs, offsets, scale, slot_map):
    rank, sm = bs[0].shape[2], torch.tensor(slot_map)
    expected = y.double().clone()
    for i, (b, off) in enumerate(zip(bs, offsets)):
        expected = lora_expand_reference(expected, lora_shrink_reference(x, a[:, i * rank:(i + 1) * rank], sm),
                                         b, scale, sm, off)
    return expected


@pytest.mark.parametrize("strategy", ["bmm", "grouped"])
@pytest.mark.parametrize("offsets,width", [([0, 16, 24], 32), ([4, 20, 30], 40)])  # slices tile y, or leave gaps
@pytest.mark.parametrize("slot_map", [[0, 1, 2, 3], [1, 1, 2, 2, 3, 3], [0, 2, 3], [-1, 1, 2, -1]])
def test_operand_views_kept_across_steps_see_slots_rewritten_in_place(strategy, offsets, width, slot_map, monkeypatch):
    """The torch path keeps a slot range's operand views between calls; a slot written in place between two
    steps (an adapter loaded into it) must be what the next step reads, and columns outside the slices stay."""
    from loramux.kernels.ops import lora_shrink_expand

    monkeypatch.setattr(torch_ops, "pick_strategy", lambda seg: strategy)
    g = torch.Generator().manual_seed(len(slot_map) + width)
    n_slots, rank, d_in, outs = 4, 8, 24, [16, 8, 8]
    a = torch.randn(n_slots, d_in, len(outs) * rank, generator=g).transpose(1, 2)  # the pool's CPU layout
    bs = [torch.randn(n_slots, rank, o, generator=g).transpose(1, 2) for o in outs]
    scale = torch.tensor([1.0, 0.5, 2.0, 0.25])
    cache: dict = {}
    for _step in range(3):
        x = torch.randn(len(slot_map), d_in, generator=g)
        y = torch.randn(len(slot_map), width, generator=g)
        expected = _stacked_reference(y, x, a, bs, offsets, scale, slot_map)
        lora_shrink_expand(y, x, a, bs, offsets, scale, LoRABatch.from_slot_map(slot_map), impl="torch",
                           operand_cache=cache)
        torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
        a[2].copy_(torch.randn(a.shape[1:], generator=g))  # "load" another adapter into slot 2
        for b in bs:
            b[2].copy_(torch.randn(b.shape[1:], generator=g))
    assert len(cache) <= 1  # one slot range: one entry, reused (none when the slots are not a range)
