"""Which decode rows share one attention call (plain Python, no torch).

Decode attention gathers each sequence's KV blocks into one padded batch: every row pays for the longest
context in it. When one stream has 600 tokens of context and fifteen have 40, one batch reads 16 x 600
tokens of KV (twice: the gather, then attention), against 1200 + 15 x 40 actually needed. Splitting the
rows into groups of similar length costs one more gather + attention call per group; `plan_decode_groups`
picks the split that minimises

    sum over groups of (GROUP_OVERHEAD_BLOCKS + rows_in_group x longest_block_count_in_group)

exactly (a dynamic programme over the rows sorted by block count: groups of a best split are contiguous
runs of that order).
"""
from __future__ import annotations

# The fixed cost of one more group, in gathered KV blocks: one gather + attention call costs about what
# gathering and attending over this many blocks costs (CPU, SmolLM2-sized heads: ~60 us vs ~3 us per block).
GROUP_OVERHEAD_BLOCKS = 20


def plan_decode_groups(block_counts: list[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[list[int]]:
    """Row indices (into `block_counts`) of each attention group, each group ascending by block count and
    the groups by their longest row. One group holding every row when splitting does not pay."""
    n = len(block_counts)
    if n <= 1:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: block_counts[i])
    blocks = [block_counts[i] for i in order]
    # best[j]: least cost of the first j rows (in `order`); cut[j]: where the last group of that split starts.
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + overhead + (j - i) * blocks[j - 1], i) for i in range(j))
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
