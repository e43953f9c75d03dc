"""The KV seam: what the scheduler and commit ask of the KV blocks and the prefix cache.

As in vLLM v1, where the scheduler decides budget and policy and asks its KVCacheManager for cached prefixes and
blocks, ``schedule`` decides who runs, how many tokens each feeds and whom to preempt, and asks ``KVManager`` for
everything about blocks:

- ``find_cached_prefix``: a waiting request's longest cached prefix of full blocks (chain hashes, each hit vetted
  by the pool's guard), and whether its first missing block is being computed by a request scheduled earlier in
  the same step (then it should wait one step and hit it, instead of computing it a second time);
- ``allocate_slots`` (an admitted request: its hits shared, fresh blocks for the rest), ``append_slots`` (a
  running request that needs more room) and ``allocate`` (fresh blocks, the decode fast path);
- ``note_computing``: the same-step bookkeeping behind ``is_pending``;
- ``register_full_blocks``: commit registers the blocks that became full, so later requests can hit them;
- ``free``: a finished, aborted or preempted request's table is released tail first, so that its prefix blocks
  are the last of it to be evicted (the pool's free queue is LRU, front evicted first).

A KVManager is local to one transition (schedule, commit or abort). It opens a pool transaction on first use and
``freeze()`` returns the new BlockPool (the old one itself when nothing was opened). Block tables stay in the
caller's columns (``RunningRows.block_tables``): the manager takes a table and returns the new one.

Worked example (block_size 2, caching on, budget 8): request A = [5, 6, 7, 8, 9] is admitted into an empty
pool: ``find_cached_prefix`` finds nothing (chain (h0,)), ``allocate_slots`` gives it blocks (0, 1, 2), and
``note_computing`` marks h0 and h1 pending. B = [5, 6, 7, 8, 1] arriving in the same step misses h0, which is
pending, so B waits. A's commit registers blocks 0 and 1 under h0 and h1; next step B hits both and computes only
its last token, in one fresh block.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from fnvllm.state._tokens import Chunks, token_slice
from fnvllm.state.config import CoreConfig
from fnvllm.state.pool import BlockPool, PoolTxn

Tokens = tuple[int, ...]


class CachedPrefix(NamedTuple):
    """What ``find_cached_prefix`` found for one request.

    blocks: the hit blocks, in order (block i holds tokens [i * block_size, (i + 1) * block_size)).
    chain: the request's chain hashes known now: the ones it had, extended through its first missing block.
    num_computed: tokens whose KV the hits hold, at most num_tokens - 1 (a fully cached prompt still computes
        its last token, whose logits it needs).
    is_pending: its first missing block is being computed by a request scheduled earlier this step.
    """

    blocks: tuple[int, ...]
    chain: Tokens
    num_computed: int
    is_pending: bool


class KVManager:
    """The blocks and prefix cache of one transition. Mutable scratch; never stored in a state."""

    __slots__ = ("_pending", "_pool", "_txn", "block_size", "caching", "hash_block")

    def __init__(self, pool: BlockPool, config: CoreConfig) -> None:
        self._pool = pool
        self._txn: PoolTxn | None = None
        self._pending: set[int] = set()  # chain hashes of full blocks being computed this step
        self.block_size = config.block_size
        self.caching = config.enable_prefix_caching
        self.hash_block = config.hash_block

    @property
    def txn(self) -> PoolTxn:
        """The pool transaction, opened on first use."""
        if self._txn is None:
            self._txn = self._pool.txn()
        return self._txn

    @property
    def num_free(self) -> int:
        """Free blocks right now (cached ones included: they are evicted when allocated)."""
        return self._pool.num_free if self._txn is None else self._txn.num_free

    def freeze(self) -> BlockPool:
        """The pool after this transition's changes (the original pool when nothing changed)."""
        return self._pool if self._txn is None else self._txn.freeze()

    # ----- prefix lookup -----

    def find_cached_prefix(self, prompt: Tokens, output: Chunks, num_tokens: int, chain: Tokens) -> CachedPrefix:
        """The longest run of cached full blocks that starts the request's ``num_tokens`` tokens (``prompt`` then
        ``output``), given the chain hashes it already knows. Each block's hash is looked up, and the pool trusts
        a hit only when its stored tokens are the request's and it was registered as the child of the block hit
        just before (``PoolTxn.lookup``), so a colliding hash costs a miss, never a wrong block."""
        if not self.caching:
            return CachedPrefix((), chain, 0, False)
        bs, txn = self.block_size, self.txn
        known = list(chain)
        hits: list[int] = []
        parent: int | None = None
        pending = False
        for index in range(num_tokens // bs):
            tokens = token_slice(prompt, output, (), index * bs, (index + 1) * bs)
            block_hash = known[index] if index < len(known) else self.hash_block(parent, tokens)
            if index == len(known):
                known.append(block_hash)
            block = txn.lookup(block_hash, hits[-1] if hits else None, tokens)
            if block is None or block in hits:
                pending = block_hash in self._pending
                break
            hits.append(block)
            parent = block_hash
        num_computed = min(len(hits) * bs, num_tokens - 1)
        return CachedPrefix(tuple(hits), tuple(known) if len(known) > len(chain) else chain, num_computed, pending)

    # ----- allocation -----

    def allocate_slots(self, prefix: CachedPrefix, num_slots: int) -> Tokens | None:
        """The block table of a request admitted with ``prefix``, covering ``num_slots`` tokens: the hit blocks
        (one more reference each) and fresh blocks after them. None, changing nothing, when the free blocks do
        not cover the fresh ones plus the free hits (a free cached hit leaves the free queue when shared)."""
        hits = prefix.blocks
        need = max(-(-num_slots // self.block_size) - len(hits), 0)
        txn = self.txn
        free_hits = sum(1 for block in hits if txn.ref_count(block) == 0)
        if need > txn.num_free - free_hits:
            return None
        for block in hits:
            txn.share(block)
        return hits + tuple(txn.allocate(need))

    def append_slots(self, table: Tokens, num_slots: int) -> Tokens | None:
        """``table`` grown with fresh blocks to cover ``num_slots`` tokens (``table`` itself when it does); None,
        changing nothing, when too few blocks are free (the scheduler then preempts and asks again)."""
        short = -(-num_slots // self.block_size) - len(table)
        if short <= 0:
            return table
        if short > self.num_free:
            return None
        return table + tuple(self.txn.allocate(short))

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks from the free queue's front (evicting their cache registrations); the caller has
        checked ``num_free``."""
        return self.txn.allocate(n)

    def free(self, table: Tokens) -> None:
        """Release one reference to each block of ``table``; blocks left unreferenced join the free queue tail
        first, so this table's prefix is evicted last (and may still be hit until then)."""
        self.txn.release(table)

    # ----- prefix-cache bookkeeping -----

    def forget_free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop the prefix-cache registrations of those ``blocks`` that no sequence holds: something wrote into
        them after they were freed (a speculative step that was then dropped, fnvllm.state.overlap), so their
        contents no longer match their registration. Held blocks are left alone."""
        if not self.caching:
            return
        pool = self._pool if self._txn is None else None
        for block in blocks:
            if pool is not None and (block not in pool.cached or block in pool.ref_counts):
                continue  # the common case: nothing to drop, and no transaction opened for it
            if self.txn.ref_count(block) == 0 and self.txn.is_cached(block):
                self.txn.unregister(block)

    def note_computing(
        self, prompt: Tokens, output: Chunks, tail: Tokens, chain: Tokens, start: int, end: int
    ) -> Tokens:
        """Mark the full blocks that tokens [start, end) complete as being computed this step, so a request
        looked up later in the step waits for them (``CachedPrefix.is_pending``); returns ``chain`` extended
        through them. A preempted request recomputes blocks whose hashes it already knows: those are marked too.
        Costs a few hashes per prefill chunk, none on decode steps (the scheduler calls it for chunks only)."""
        if not self.caching:
            return chain
        bs, last = self.block_size, end // self.block_size
        if last > len(chain):
            known = list(chain)
            for index in range(len(known), last):
                parent = known[index - 1] if index else None
                known.append(self.hash_block(parent, token_slice(prompt, output, tail, index * bs, (index + 1) * bs)))
            chain = tuple(known)
        # from start's own block: a chunk that starts inside a block (begun in an earlier step) completes it too
        self._pending.update(chain[start // bs : last])
        return chain

    def register_full_blocks(
        self, prompt: Tokens, output: Chunks, tail: Tokens, table: Tokens, chain: Tokens, start: int, end: int
    ) -> Tokens:
        """Register the blocks of ``table`` that computing tokens [start, end) filled, each as the child of the
        block before it; returns ``chain`` extended through them (its full blocks before ``start`` are known:
        commit extends the chain whenever a block fills)."""
        bs = self.block_size
        if not self.caching or end // bs == start // bs:
            return chain
        known, txn = list(chain), self.txn
        for block in range(start // bs, end // bs):
            tokens = token_slice(prompt, output, tail, block * bs, (block + 1) * bs)
            parent = known[block - 1] if block else None
            if block == len(known):
                known.append(self.hash_block(parent, tokens))
            txn.register(table[block], table[block - 1] if block else None, known[block], parent, tokens)
        return tuple(known)
