"""Segments: runs of consecutive tokens that share one adapter slot (pure Python, torch-free).

The LoRA kernels work per segment: every token of a segment multiplies the same A and B matrices,
so a segment is one small GEMM. Rows with slot -1 (the base model alone) belong to no segment.
"""
from __future__ import annotations

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
