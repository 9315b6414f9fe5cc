"""Paged KV-cache bookkeeping: fixed-size blocks handed to sequences, with automatic prefix caching
(torch-free).

Blocks are reference counted. With prefix caching on, a block whose KV is fully computed gets a content
hash chained over everything before it: hash(parent hash, its token ids, the cache salt). The salt is
the sequence's adapter version digest and, when tenants are isolated, its tenant, because a LoRA on any
layer changes the KV of the same text, so blocks are never shared across adapter versions. A new
sequence whose leading full blocks hash the same reuses them read-only and skips their prefill.
Unreferenced cached blocks stay in an LRU pool and count as free: they are evicted (their hash
forgotten) only when an allocation needs the room.

With a sliding window on every layer (Mistral v0.1), a block whose tokens every later query is too far from
to see is released while its sequence runs (`release_out_of_window`): its table entry becomes
`RELEASED` (the runner reads it as its scratch block, which attention masks) and the block goes back to
the pool, or to the cache's LRU when hashed, so a later prompt with the same prefix can still reuse it.

A hybrid model (linear-attention layers) also gives each sequence one of `num_state_slots` fixed-size state slots,
taken with its first blocks and given back with them: the linear layers' state lives there instead of in blocks.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque
from typing import Protocol

from loramux.engine.sequence import Sequence

RELEASED = -1  # a block-table entry whose block left the sliding window and went back to the pool


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for the requested allocation."""


class HeldBlocks(Protocol):
    """What `free` reads and resets: an engine Sequence, or the draft model's own state of a request."""

    block_table: list[int]
    block_hashes: list[bytes]
    num_released_blocks: int


class GrowingBlocks(HeldBlocks, Protocol):
    """What `allocate` reads: held blocks, and the tokens whose KV is in them."""

    @property
    def num_computed_tokens(self) -> int: ...


def chain_hash(parent: bytes, token_ids, salt: str) -> bytes:
    """The content hash of one full block, chained to the hash of the block before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(salt.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None, num_state_slots: int = 0):
        """`sliding_window`: the window of every layer of the model, when they all have one; `num_state_slots`: the
        per-sequence state slots of a hybrid model, 0 for others (see the module)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # no reusable content
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.hits = 0  # blocks reused from the cache (for stats)
        self.num_state_slots = num_state_slots
        # a heap: the lowest free slot goes first, so running sequences' slots stay close together and a decode
        # step's usually form one range the model reads in place (loramux.model.linear_attention)
        self.free_state_slots: list[int] = list(range(num_state_slots))

    def _needs_state_slot(self, seq) -> bool:
        return self.num_state_slots > 0 and getattr(seq, "state_slot", None) is None

    def _slot_available(self, seq) -> bool:
        return not self._needs_state_slot(seq) or bool(self.free_state_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: GrowingBlocks, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that its next `num_new_tokens` tokens have KV slots."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: GrowingBlocks, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks and self._slot_available(seq)

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)  # least recently used cached block
            digest = self.block_hash[block]
            assert digest is not None  # evictable blocks are cached ones, which have a hash
            del self.cached[digest]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: GrowingBlocks, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens; all or nothing."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"need {need} KV blocks, {self.num_free_blocks} free")
        if self._needs_state_slot(seq):
            if not self.free_state_slots:
                raise OutOfBlocksError(f"every one of the {self.num_state_slots} state slots is taken")
            seq.state_slot = heapq.heappop(self.free_state_slots)  # type: ignore[attr-defined]
        for _ in range(need):
            seq.block_table.append(self._take())

    def free(self, seq: HeldBlocks) -> None:
        """Release every block of `seq` (idempotent); cached blocks stay reusable until evicted."""
        for block in reversed(seq.block_table):
            if block != RELEASED:
                self._unref(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_released_blocks = 0
        slot = getattr(seq, "state_slot", None)
        if slot is not None:
            heapq.heappush(self.free_state_slots, slot)
            seq.state_slot = None  # type: ignore[attr-defined]

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of `seq` no query from its next token on can see (all their positions are
        at least `sliding_window` before it); returns how many were released. Call after `commit`."""
        if self.sliding_window is None:
            return 0
        # The next query is at position num_computed_tokens; it sees keys > that - window.
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        done = max(0, min(first_visible // self.block_size, len(seq.block_table)))
        released = 0
        for i in range(seq.num_released_blocks, done):
            self._unref(seq.block_table[i])
            seq.block_table[i] = RELEASED
            released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, done)
        return released

    # -- prefix caching ----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks. At least the last prompt token is always
        left to compute, since its logits start the generation."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return []
        bs, tokens = self.block_size, seq.token_ids
        hashes, blocks, parent = [], [], b""
        for i in range((len(tokens) - 1) // bs):
            parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs], seq.cache_salt)
            block = self.cached.get(parent)
            if block is None:
                break
            hashes.append(parent)
            blocks.append(block)
        seq.block_hashes = hashes
        return blocks

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` (with `hits` reused) can get blocks for `num_new_tokens` tokens after them."""
        reused_free = sum(1 for b in hits if self.ref_counts[b] == 0)  # they stop counting as free
        need = self.blocks_for_tokens(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return need <= self.num_free_blocks - reused_free and self._slot_available(seq)

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Give `seq` the cached `hits` (their tokens count as computed), then room for the rest."""
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        self.hits += len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_hashes = seq.block_hashes[:len(hits)]
        try:
            self.allocate(seq, num_new_tokens)
        except OutOfBlocksError:
            self.free(seq)
            seq.num_computed_tokens = 0
            raise

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s newly completed full blocks in the cache (call after their KV is written)."""
        if not self.enable_prefix_caching:
            return
        bs, tokens = self.block_size, None
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            if tokens is None:
                tokens = seq.token_ids
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            digest = chain_hash(parent, tokens[i * bs:(i + 1) * bs], seq.cache_salt)
            seq.block_hashes.append(digest)
            block = seq.block_table[i]
            if self.block_hash[block] is None and digest not in self.cached:
                self.block_hash[block] = digest
                self.cached[digest] = block
            # else: the same content is cached in another block already (computed twice concurrently):
            # this copy stays private and is freed normally.

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert that every block is either free, cached-and-unreferenced, or referenced exactly by live
        sequences (tests)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                if block != RELEASED:
                    counts[block] += 1
        assert counts == self.ref_counts, "reference counts disagree with the live block tables"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not free & set(self.evictable), "a block is both free and cached"
        idle = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert free | set(self.evictable) == idle, "leaked or double-used block"
        assert all(self.block_hash[b] is not None for b in self.evictable), "an evictable block has no hash"
        assert all(self.block_hash[b] == h for h, b in self.cached.items()), "cache index out of sync"
        held = [s for s in (getattr(seq, "state_slot", None) for seq in live) if s is not None]
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + list(self.free_state_slots)) == list(range(self.num_state_slots)), "leaked state slot"
