"""Named output slices of a stacked projection (q, k, v; gate, up; each expert's gate and up)."""
from __future__ import annotations


def slice_bounds(slices: tuple[tuple[str, int], ...], name: str) -> tuple[int, int]:
    """Columns [start, end) of slice `name` among `slices` ((name, width), ...), which are laid out in order."""
    start = 0
    for slice_name, size in slices:
        if slice_name == name:
            return start, start + size
        start += size
    raise KeyError(name)
