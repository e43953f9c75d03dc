"""BlockPool: the KV blocks' bookkeeping — reference counts, the LRU free queue and the prefix-cache tables.

Every block is in exactly one of two places: the free queue (ref count 0) or ``ref_counts`` (ref count >= 1).
A full block that was computed is registered in the cache tables and keeps its registration while free, until
it is popped from the free queue for reuse (eviction). Each registration gets a serial number never used before,
and records its parent's: a block is only reused by a sequence that hit that very parent registration, so the
guard does not depend on the hash function (a block evicted and registered again gets a new serial, and the
children registered under its old one can never match again). The free queue's front is evicted first; a released
sequence's blocks are appended tail-first so its prefix blocks are the last of them to be evicted.

Transitions never touch a BlockPool: the KV seam (``KVManager`` in kv.py, which schedule, commit and abort
call) opens a ``PoolTxn`` (a scratch builder local to one transition), applies all of the step's changes to it,
and ``freeze()`` yields a new BlockPool once. This module is the mechanism (counts, queue, registrations and
the lookup guard); kv.py decides which blocks a request gets, hits, registers and frees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs

from fnvllm.state._pmap import Evolver, PMap


class CachedBlock(NamedTuple):
    """Registration of one full, computed block: its chain hash, its parent's hash, its token ids, the serial of
    this registration and the serial of its parent's registration (None for a sequence's first block)."""

    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    serial: int
    parent_serial: int | None


@attrs.frozen(eq=False)
class BlockPool:
    """Immutable snapshot of the KV block bookkeeping.

    num_blocks: blocks in the pool; ids are 0 .. num_blocks-1.
    free_queue (property): free block ids, front evicted (reused) first.
    ref_counts: block id -> number of sequences holding it, for held blocks only.
    cached: block id -> its registration, for blocks holding a full registered block (held or free).
    hash_to_block: chain hash -> block id, the prefix-cache index (the inverse of ``cached``).
    next_serial: the serial the next registration gets (serials are never reused).

    The free queue is stored as ``free_buffer[free_head:]``: a step that only pops blocks from the front shares
    the previous buffer and moves the head, instead of copying thousands of free block ids. Equality compares
    the free queue itself, not how it is stored.
    """

    num_blocks: int
    free_buffer: tuple[int, ...]
    free_head: int = 0
    ref_counts: PMap[int, int] = attrs.field(factory=PMap)
    cached: PMap[int, CachedBlock] = attrs.field(factory=PMap)
    hash_to_block: PMap[int, int] = attrs.field(factory=PMap)
    next_serial: int = 0

    @classmethod
    def create(cls, num_blocks: int) -> BlockPool:
        """A pool with every block free and nothing cached."""
        return cls(num_blocks, tuple(range(num_blocks)))

    @property
    def free_queue(self) -> tuple[int, ...]:
        """Free block ids, front evicted (reused) first."""
        return self.free_buffer[self.free_head :]

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (cached or not)."""
        return len(self.free_buffer) - self.free_head

    def txn(self) -> PoolTxn:
        """Open a scratch builder for one transition's changes."""
        return PoolTxn(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockPool):
            return NotImplemented
        return (
            self.num_blocks == other.num_blocks
            and self.free_queue == other.free_queue
            and self.ref_counts == other.ref_counts
            and self.cached == other.cached
            and self.hash_to_block == other.hash_to_block
            and self.next_serial == other.next_serial
        )

    __hash__ = None  # type: ignore[assignment]  # equal by contents, and PMaps are unhashable


class PoolTxn:
    """Mutable, transition-local view of a BlockPool. ``freeze()`` yields the new BlockPool.

    The free queue is represented as the old tuple read from ``head`` onwards, minus blocks taken out of the
    middle (``removed``, prefix-cache hits on free blocks), plus newly released blocks (``appended``, ordered).
    """

    __slots__ = ("_appended", "_cached", "_hashes", "_head", "_queue", "_refs", "_removed", "_serial", "num_blocks")

    def __init__(self, pool: BlockPool) -> None:
        self.num_blocks = pool.num_blocks
        self._queue = pool.free_buffer
        self._head = pool.free_head
        self._removed: set[int] = set()
        self._appended: dict[int, None] = {}
        self._refs: Evolver[int, int] = pool.ref_counts.evolver()
        self._cached: Evolver[int, CachedBlock] = pool.cached.evolver()
        self._hashes: Evolver[int, int] = pool.hash_to_block.evolver()
        self._serial = pool.next_serial

    @property
    def num_free(self) -> int:
        """Free blocks right now in this transaction."""
        return len(self._queue) - self._head - len(self._removed) + len(self._appended)

    def ref_count(self, block: int) -> int:
        """Current holders of ``block``."""
        return self._refs.get(block) or 0

    def lookup(self, block_hash: int, parent_block: int | None, tokens: Sequence[int]) -> int | None:
        """The cached block with this chain hash, if it holds these tokens and was registered as the child of
        ``parent_block``'s current registration (the block hit just before it; None for a first block).

        This guard is sound whatever the hash function: by induction, a hit's whole prefix holds the same tokens
        as the caller's, computed in the same blocks. A colliding hash only costs a miss."""
        block = self._hashes.get(block_hash)
        if block is None:
            return None
        entry = self._cached[block]
        if parent_block is None:
            if entry.parent_serial is not None:
                return None
        else:
            parent = self._cached.get(parent_block)
            if parent is None or entry.parent_serial != parent.serial:
                return None
        if entry.tokens != tuple(tokens):
            return None
        return block

    def share(self, block: int) -> None:
        """Take one more reference to a cached block, pulling it out of the free queue if it was free."""
        count = self._refs.get(block)
        if count is None:
            self._remove_free(block)
            self._refs.set(block, 1)
        else:
            self._refs.set(block, count + 1)

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the free queue's front (evicting their cache registration). Caller checks room."""
        blocks = [self._pop_free() for _ in range(n)]
        for block in blocks:
            self._refs.set(block, 1)
            entry = self._cached.get(block)
            if entry is not None:
                self._cached.delete(block)
                self._hashes.delete(entry.hash)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's back, tail first."""
        for block in reversed(blocks):
            count = self._refs[block]
            if count == 1:
                self._refs.delete(block)
                self._appended[block] = None
            else:
                self._refs.set(block, count - 1)

    def register(
        self, block: int, parent_block: int | None, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]
    ) -> None:
        """Record that ``block`` holds the full block ``tokens`` with this chain hash, computed right after
        ``parent_block`` (the previous block of the same block table; None for a first block). Nothing is recorded
        when the hash or the block is taken, or when ``parent_block`` carries no registration (a child is only
        reachable through its parent's registration, which it names by serial)."""
        if block_hash in self._hashes or block in self._cached:
            return
        if parent_block is None:
            parent_serial = None
        else:
            parent = self._cached.get(parent_block)
            if parent is None:
                return
            parent_serial = parent.serial
        serial = self._serial
        self._serial = serial + 1
        self._cached.set(block, CachedBlock(block_hash, parent_hash, tokens, serial, parent_serial))
        self._hashes.set(block_hash, block)

    def is_cached(self, block: int) -> bool:
        """True when ``block`` carries a prefix-cache registration."""
        return block in self._cached

    def unregister(self, block: int) -> None:
        """Drop ``block``'s prefix-cache registration (if any), e.g. because its contents were overwritten. Its
        children stay registered but can never be hit again: a hit needs its parent's registration."""
        entry = self._cached.get(block)
        if entry is not None:
            self._cached.delete(block)
            self._hashes.delete(entry.hash)

    def freeze(self) -> BlockPool:
        """The new immutable pool (the transaction may go on; later changes do not reach this pool)."""
        queue, head = self._queue, self._head
        if self._removed or self._appended:  # rebuild; otherwise share the buffer and move the head
            rest: Iterable[int] = queue[head:]
            if self._removed:
                rest = (b for b in rest if b not in self._removed)
            queue, head = tuple(rest) + tuple(self._appended), 0
            self._queue, self._head, self._removed, self._appended = queue, 0, set(), {}
        return BlockPool(
            self.num_blocks,
            queue,
            head,
            self._refs.persistent(),
            self._cached.persistent(),
            self._hashes.persistent(),
            self._serial,
        )

    def _pop_free(self) -> int:
        while self._head < len(self._queue):
            block = self._queue[self._head]
            self._head += 1
            if block in self._removed:
                self._removed.discard(block)
                continue
            return block
        block = next(iter(self._appended))
        del self._appended[block]
        return block

    def _remove_free(self, block: int) -> None:
        if block in self._appended:
            del self._appended[block]
        else:
            self._removed.add(block)
