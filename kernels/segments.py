"""Segments and groups of the rows that share one adapter slot (pure Python, torch-free).

The Triton kernels work per segment (a run of consecutive rows of one slot): every row of a segment
multiplies the same A and B matrices, so a segment is one small GEMM tile. The torch path works per group
(all rows of one slot, wherever they sit) so that one batched GEMM serves every adapter of a step.
Rows with slot -1 (the base model alone) belong to neither.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

NO_ADAPTER = -1


@dataclass(frozen=True)
class Segments:
    """Kernel metadata for one batch.

    starts[i], lengths[i], slots[i]: segment i covers rows [starts[i], starts[i] + lengths[i]) and uses
    adapter slot slots[i]. `num_tokens` is the batch's row count; `max_length` the longest segment;
    `active_slots` the distinct slots in order of first use; `max_slot` the highest (-1 if none).
    """

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    num_tokens: int
    max_length: int
    active_slots: tuple[int, ...]
    max_slot: int

    @property
    def num_segments(self) -> int:
        return len(self.starts)

    @property
    def has_lora(self) -> bool:
        return bool(self.starts)


def build_segments(slot_map: Sequence[int]) -> Segments:
    """Split a per-token slot map into maximal runs of equal slots, dropping base-only runs."""
    starts: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    prev = NO_ADAPTER
    for row, slot in enumerate(slot_map):
        if slot < NO_ADAPTER:
            raise ValueError(f"slot ids must be >= -1, got {slot} at row {row}")
        if slot != NO_ADAPTER and slot == prev:
            lengths[-1] += 1
        elif slot != NO_ADAPTER:
            starts.append(row)
            lengths.append(1)
            slots.append(slot)
        prev = slot
    active = tuple(dict.fromkeys(slots))
    return Segments(tuple(starts), tuple(lengths), tuple(slots), len(slot_map), max(lengths, default=0), active,
                    max(slots, default=NO_ADAPTER))


@dataclass(frozen=True)
class Groups:
    """A batch's adapter rows grouped by slot, for one batched GEMM per layer (the torch CPU path).

    Group g holds the rows `rows[offsets[g]:offsets[g + 1]]` (in batch order), all of slot `slots[g]`;
    slots ascend. `span` is (start, stop) when the groups are exactly the rows start..stop-1 in batch
    order with equal counts, so the batch reshapes to [groups, count] with no gather; else None.
    """

    slots: tuple[int, ...]
    rows: tuple[int, ...]
    offsets: tuple[int, ...]  # len(slots) + 1 cumulative counts
    max_count: int
    span: tuple[int, int] | None

    @property
    def num_groups(self) -> int:
        return len(self.slots)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def padded_rows(self) -> list[int]:
        """num_groups * max_count rows: each group's rows, padded by repeating the group's first row."""
        out: list[int] = []
        for g in range(self.num_groups):
            rows = self.rows[self.offsets[g]:self.offsets[g + 1]]
            out.extend(rows + (rows[0],) * (self.max_count - len(rows)))
        return out


def build_groups(slot_map: Sequence[int]) -> Groups:
    """Group the rows of a per-token slot map by slot (base-only rows, -1, belong to no group)."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(slot_map):
        if slot < NO_ADAPTER:
            raise ValueError(f"slot ids must be >= -1, got {slot} at row {row}")
        if slot != NO_ADAPTER:
            rows_of.setdefault(slot, []).append(row)
    slots = tuple(sorted(rows_of))
    rows = tuple(r for s in slots for r in rows_of[s])
    counts = [len(rows_of[s]) for s in slots]
    offsets = (0, *itertools.accumulate(counts))
    uniform = len(set(counts)) <= 1
    contiguous = bool(rows) and rows == tuple(range(rows[0], rows[0] + len(rows)))
    span = (rows[0], rows[0] + len(rows)) if rows and uniform and contiguous else None
    return Groups(slots, rows, offsets, max(counts, default=0), span)
