"""CPU (and fallback) implementations of the LoRA shrink / expand ops in plain torch.

Semantics (shared with the Triton kernels):
    lora_shrink: v[t, :]  = x[t, :] @ A[slot[t]]^T                     for rows with an adapter, else 0
    lora_expand: y[t, o:o+d_out] += (v[t, :] @ B[slot[t]]^T) * scale[slot[t]]   for rows with an adapter
with A: [n_slots, R, d_in], B: [n_slots, d_out, R] (PEFT's lora_A / lora_B per slot) and scale: [n_slots].

The rows of a step are grouped by slot once (`GroupedRows`, shared by every layer), and each op is then
one batched GEMM over all groups, whatever the number of adapters: no Python per adapter, every active
adapter's weights read once, no wasted multiply-adds. Two strategies (bench/multi_lora.py measures them):
  * bmm:     groups padded to the largest group's row count and multiplied as one `torch.bmm`
             ([groups, rows, d_in] x [groups, d_in, R]). Decode rows are sorted by slot (model_runner),
             so a decode batch is usually already in that shape: no gather, no scatter.
  * grouped: `torch._grouped_mm` over the rows sorted by slot, with each group's own length: for skewed
             steps (a long prefill next to single decode rows) where padding would multiply mostly
             copies. Used only where torch has it for these tensors; bmm is the fallback.
The slot pool stores A as [slots, d_in, R] and B as [slots, R, d_out] on CPU, so the operands of a
contiguous range of slots are views in the layout the GEMMs read fastest.
"""
from __future__ import annotations

from functools import cache

import torch

from loramux.kernels.segments import Groups

# Pad to the largest group while padded rows stay under this multiple of the real rows; beyond it the
# copies cost more than grouped_mm's per-group calls (bench/multi_lora.py, "CPU LoRA kernel strategies").
BMM_MAX_PADDING = 2.0


@cache
def grouped_mm_available() -> bool:
    """Whether this torch has a CPU `torch._grouped_mm` that agrees with a per-group matmul."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x, w = torch.randn(6, 16), torch.randn(2, 16, 8)
    try:
        out = torch._grouped_mm(x, w, offs=torch.tensor([2, 6], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return torch.allclose(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]), atol=1e-5)


def pick_strategy(groups: Groups) -> str:
    padded = groups.num_groups * groups.max_count
    if groups.num_groups > 1 and padded > BMM_MAX_PADDING * groups.num_rows and grouped_mm_available():
        return "grouped"
    return "bmm"


def _aligned(*tensors: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte aligned data and strides."""
    return all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride() if s != 1)
               for t in tensors)


class GroupedRows:
    """One step's `Groups` as tensors on the device, and the per-group views of slot stacks."""

    def __init__(self, groups: Groups, device: torch.device | str, strategy: str | None = None):
        self.groups = groups
        self.strategy = strategy or pick_strategy(groups)
        tensor = lambda v, dtype=torch.long: torch.tensor(v, dtype=dtype, device=device)  # noqa: E731
        slots = groups.slots
        self.slot_range = (slots[0], slots[-1] + 1) if slots and slots[-1] - slots[0] + 1 == len(slots) else None
        self.slot_index = None if self.slot_range or not slots else tensor(slots)
        counts = [groups.offsets[g + 1] - groups.offsets[g] for g in range(groups.num_groups)]
        self._counts = counts
        self.contiguous = bool(groups.rows) and groups.rows == tuple(range(groups.rows[0],
                                                                             groups.rows[0] + groups.num_rows))
        # bmm: rows of the padded [groups, max_count] layout (None: the span reshapes in place).
        self.pad_index = None if groups.span else tensor(groups.padded_rows())
        # grouped: the rows in group order and each group's end offset.
        self.row_index = None if self.contiguous else tensor(groups.rows)
        self.offs = tensor(groups.offsets[1:], torch.int32)
        self._scales: dict = {}

    def per_group(self, stack: torch.Tensor) -> torch.Tensor:
        """stack [n_slots, ...] -> [groups, ...]: a view for a contiguous slot range, else a copy."""
        if self.slot_range is not None:
            return stack[self.slot_range[0]:self.slot_range[1]]
        return stack.index_select(0, self.slot_index)

    def row_scale(self, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each laid-out row's scale[slot]: [groups, max_count, 1] for bmm (0 on padding), [rows, 1] else.
        A per-slice scale [n_slices, n_slots] gives n_slices columns instead of 1 (column i: slice i)."""
        key = (id(scale), dtype)
        if key not in self._scales:
            g = self.per_group(scale.unsqueeze(1) if scale.dim() == 1 else scale.t()).to(dtype)  # [groups, n]
            if self.strategy == "bmm":
                live = torch.arange(self.groups.max_count, device=scale.device)[None, :] < \
                    torch.tensor(self._counts, device=scale.device)[:, None]
                self._scales[key] = (live.unsqueeze(2) * g[:, None, :]).to(dtype)
            else:
                self._scales[key] = g.repeat_interleave(torch.tensor(self._counts, device=scale.device), dim=0)
        return self._scales[key]

    # -- the two layouts ------------------------------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> the rows in this layout: [groups, max_count, d] (bmm) or [rows, d] (grouped)."""
        g = self.groups
        if self.strategy == "bmm":
            if g.span is not None:
                return x[g.span[0]:g.span[1]].view(g.num_groups, g.max_count, x.shape[1])
            return x.index_select(0, self.pad_index).view(g.num_groups, g.max_count, x.shape[1])
        if self.contiguous:
            return x[g.rows[0]:g.rows[0] + g.num_rows]
        return x.index_select(0, self.row_index)

    def matmul(self, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """xs in this layout times each group's w [groups, k, n] (the group's own matrix)."""
        if self.strategy == "grouped" and _aligned(xs, w):
            return torch._grouped_mm(xs, w, offs=self.offs)
        if self.strategy == "grouped":  # unaligned operands: one small GEMM per group
            out = xs.new_empty(xs.shape[0], w.shape[2])
            for gi, (lo, hi) in enumerate(zip((0, *self.groups.offsets[1:-1]), self.groups.offsets[1:])):
                torch.matmul(xs[lo:hi], w[gi], out=out[lo:hi])
            return out
        return torch.bmm(xs, w)

    def laid_out_view(self, y: torch.Tensor) -> torch.Tensor | None:
        """A view of y's rows in this layout when they already are (no gather needed), else None."""
        g = self.groups
        if self.strategy == "bmm" and g.span is not None:
            return y[g.span[0]:g.span[1]].view(g.num_groups, g.max_count, y.shape[1])
        if self.strategy == "grouped" and self.contiguous:
            return y[g.rows[0]:g.rows[0] + g.num_rows]
        return None

    def scatter_add(self, y: torch.Tensor, delta: torch.Tensor) -> None:
        """y[row] += delta for every laid-out row (padding rows carry zeros: their scale is 0)."""
        g = self.groups
        if self.strategy == "bmm" and g.span is not None:
            y[g.span[0]:g.span[1]].view(g.num_groups, g.max_count, y.shape[1]).add_(delta)
        elif self.strategy == "bmm":
            y.index_add_(0, self.pad_index, delta.reshape(-1, delta.shape[-1]))
        elif self.contiguous:
            y[g.rows[0]:g.rows[0] + g.num_rows].add_(delta)
        else:
            y.index_add_(0, self.row_index, delta)

    def scatter_copy(self, v: torch.Tensor, laid_out: torch.Tensor) -> None:
        """v[row] = laid_out row (a padding row repeats its group's first row, so duplicates agree)."""
        g = self.groups
        if self.strategy == "bmm" and g.span is not None:
            v[g.span[0]:g.span[1]] = laid_out.reshape(-1, v.shape[1])
        elif self.strategy == "bmm":
            v.index_copy_(0, self.pad_index, laid_out.reshape(-1, v.shape[1]))
        elif self.contiguous:
            v[g.rows[0]:g.rows[0] + g.num_rows] = laid_out
        else:
            v.index_copy_(0, self.row_index, laid_out)


def _a_operand(rows: GroupedRows, a: torch.Tensor) -> torch.Tensor:
    return rows.per_group(a).transpose(1, 2)  # [groups, d_in, R]: a view in the slot pool's CPU layout


def _b_operand(rows: GroupedRows, b: torch.Tensor) -> torch.Tensor:
    return rows.per_group(b).transpose(1, 2)  # [groups, R, d_out]


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, rows: GroupedRows) -> torch.Tensor:
    """v [T, R] (dtype of x); rows without an adapter are zero."""
    v = x.new_zeros(x.shape[0], a.shape[1])
    if rows.groups.num_rows:
        rows.scatter_copy(v, rows.matmul(rows.gather(x), _a_operand(rows, a)))
    return v


def lora_expand_torch(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: GroupedRows,
                      col_offset: int = 0) -> None:
    """In place: y[:, col_offset:col_offset + d_out] += (v @ B[slot]^T) * scale[slot] on adapter rows."""
    if not rows.groups.num_rows:
        return
    vs = rows.gather(v) * rows.row_scale(scale, v.dtype)
    rows.scatter_add(y[:, col_offset:col_offset + b.shape[1]], rows.matmul(vs, _b_operand(rows, b)))


# Distinct slot ranges whose operand views one projection keeps; a step uses one or two.
OPERAND_CACHE_SIZE = 16


def _operands(rows: GroupedRows, a: torch.Tensor, bs: list[torch.Tensor],
              cache: dict | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The GEMM operands of this step's groups. For a contiguous slot range they are views of the slot
    stacks, kept in `cache` across steps: building them is a few Python-level torch calls per slice, and
    a decode step makes about a hundred LoRA calls."""
    if rows.slot_range is None or cache is None:
        return _a_operand(rows, a), [_b_operand(rows, b) for b in bs]
    hit = cache.get(rows.slot_range)
    if hit is None:
        if len(cache) >= OPERAND_CACHE_SIZE:
            cache.clear()
        hit = cache[rows.slot_range] = (_a_operand(rows, a), [_b_operand(rows, b) for b in bs])
    return hit


def shrink_expand_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                        offsets: list[int], scale: torch.Tensor, rows: GroupedRows, cache: dict | None = None) -> None:
    """Stacked slices in one pass: one shrink against A = [n_slots, R_0 + R_1 + ..., d_in] in the grouped
    layout, scaled there, then one expand per slice (B_i [n_slots, d_out_i, R_i]) added into y's columns
    offsets[i]... `scale`: [n_slots], or [n_slices, n_slots] for a scale per slice.
    `cache`: a dict owned by these very slot stacks (see `_operands`), or None."""
    if not rows.groups.num_rows:
        return
    a_op, b_ops = _operands(rows, a, bs, cache)
    v = rows.matmul(rows.gather(x), a_op)
    ranks = [b.shape[2] for b in bs]
    v_slices = v.split(ranks, -1) if len(set(ranks)) > 1 else v.split(ranks[0], -1)
    row_scale = rows.row_scale(scale, v.dtype)
    if scale.dim() == 1:
        v.mul_(row_scale)
    else:  # each slice its own scale: the same one multiply per element, by that slice's column
        for i, v_slice in enumerate(v_slices):
            v_slice.mul_(row_scale[..., i:i + 1])
    laid_out = rows.laid_out_view(y)
    if laid_out is not None:  # y's rows already sit in the groups' layout: add each slice's product in place
        for v_slice, y_slice, b in zip(v_slices, _column_slices(laid_out, bs, offsets), b_ops):
            y_slice.add_(rows.matmul(v_slice, b))
        return
    for v_slice, b, b_op, offset in zip(v_slices, bs, b_ops, offsets):
        rows.scatter_add(y[:, offset:offset + b.shape[1]], rows.matmul(v_slice, b_op))


def _column_slices(t: torch.Tensor, bs: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Views of t's last dimension at each slice's columns (one split when the slices tile it)."""
    sizes = [b.shape[1] for b in bs]
    if offsets[0] == 0 and sum(sizes) == t.shape[-1] and all(
            offsets[i + 1] == offsets[i] + sizes[i] for i in range(len(sizes) - 1)):
        return [t] if len(sizes) == 1 else list(t.split(sizes, -1))
    return [t[..., offset:offset + size] for offset, size in zip(offsets, sizes)]


def lora_shrink_reference(x, a, slot_map):
    """Float64 reference of lora_shrink, one row at a time (tests and bench/gpu_check.py)."""
    x64, a64 = x.double().cpu(), a.double().cpu()
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            v[t] = x64[t] @ a64[slot].t()
    return v


def lora_expand_reference(y, v, b, scale, slot_map, col_offset=0):
    """Float64 reference of lora_expand, one row at a time; returns a new tensor."""
    out = y.double().cpu().clone()
    v64, b64, scale64 = v.double().cpu(), b.double().cpu(), scale.double().cpu()
    d_out = b.shape[1]
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            out[t, col_offset:col_offset + d_out] += (v64[t] @ b64[slot].t()) * scale64[slot]
    return out
