"""Paged KV-cache bookkeeping: fixed-size blocks handed to sequences (torch-free).

Blocks carry reference counts so that later features (prefix caching) can share a block between
sequences; a block returns to the free list when its count drops to zero.
"""
from __future__ import annotations

from collections import deque

from loramux.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for the requested allocation."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that its next `num_new_tokens` tokens have KV slots."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens; all or nothing."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            raise OutOfBlocksError(f"need {need} KV blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (idempotent)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert that every block is either free or referenced exactly by live sequences (tests)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                counts[block] += 1
        assert counts == self.ref_counts, "reference counts disagree with the live block tables"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "leaked or double-used block"
