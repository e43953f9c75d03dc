"""Targeted properties of the block pool (PoolTxn / BlockPool) and of PMap, each against a naive model, and the
KV seam's worked example."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from fnvllm.state import CoreConfig, chain_hashes
from fnvllm.state._pmap import PMap
from fnvllm.state.kv import KVManager
from fnvllm.state.pool import BlockPool, CachedBlock, PoolTxn
from fnvllm.testing.invariants import snapshot

BLOCKS = st.integers(1, 12)


def register(txn: PoolTxn | NaivePool, block: int, tag: int, parent_block: int | None = None) -> None:
    """Register ``block`` with hash ``tag`` and tokens (tag, tag) after ``parent_block`` (tests pick distinct tags)."""
    txn.register(block, parent_block, tag, None, (tag, tag))


class NaivePool:
    """The pool's rules spelled out on a list and three dicts."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.cached: dict[int, CachedBlock] = {}
        self.hashes: dict[int, int] = {}
        self.serial = 0

    def allocate(self, n: int) -> list[int]:
        blocks, self.free = self.free[:n], self.free[n:]
        for b in blocks:
            self.refs[b] = 1
            if b in self.cached:
                del self.hashes[self.cached.pop(b).hash]
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free.append(b)

    def share(self, b: int) -> None:
        if b in self.refs:
            self.refs[b] += 1
        else:
            self.free.remove(b)
            self.refs[b] = 1

    def register(self, b: int, parent_b: int | None, h: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        if h in self.hashes or b in self.cached or (parent_b is not None and parent_b not in self.cached):
            return
        parent_serial = None if parent_b is None else self.cached[parent_b].serial
        self.cached[b] = CachedBlock(h, parent, tokens, self.serial, parent_serial)
        self.hashes[h] = b
        self.serial += 1

    def lookup(self, h: int, parent_b: int | None, tokens: tuple[int, ...]) -> int | None:
        b = self.hashes.get(h)
        if b is None or self.cached[b].tokens != tokens:
            return None
        if parent_b is None:
            return b if self.cached[b].parent_serial is None else None
        parent = self.cached.get(parent_b)
        return b if parent is not None and self.cached[b].parent_serial == parent.serial else None


def assert_same(pool: BlockPool, model: NaivePool) -> None:
    """The frozen pool equals the model, field by field."""
    assert pool.free_queue == tuple(model.free)
    assert dict(pool.ref_counts.items()) == model.refs
    assert dict(pool.cached.items()) == model.cached
    assert dict(pool.hash_to_block.items()) == model.hashes
    assert pool.next_serial == model.serial


def apply_random_op(data: st.DataObject, txn: PoolTxn, model: NaivePool) -> None:
    """Draw one legal pool operation and apply it to both the transaction and the model."""
    held = sorted(model.refs)
    ops = ["allocate", "lookup"] + (["release", "register"] if held else []) + (["share"] if model.cached else [])
    op = data.draw(st.sampled_from(ops), label="op")
    if op == "allocate":
        n = data.draw(st.integers(0, len(model.free)), label="n")
        assert txn.allocate(n) == model.allocate(n)
    elif op == "release":
        table = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True), label="table")
        txn.release(table)
        model.release(table)
    elif op == "share":
        block = data.draw(st.sampled_from(sorted(model.cached)), label="block")
        txn.share(block)
        model.share(block)
    elif op == "register":
        block, tag = data.draw(st.sampled_from(held), label="block"), data.draw(st.integers(0, 5), label="hash")
        parent = data.draw(st.none() | st.integers(0, txn.num_blocks - 1), label="parent block")
        register(txn, block, tag, parent)
        register(model, block, tag, parent)
    else:
        tag = data.draw(st.integers(0, 5), label="hash")
        parent = data.draw(st.none() | st.integers(0, txn.num_blocks - 1), label="parent block")
        tokens = data.draw(st.sampled_from([(tag, tag), (0, 1)]), label="tokens")
        assert txn.lookup(tag, parent, tokens) == model.lookup(tag, parent, tokens)
    assert txn.num_free == len(model.free)
    assert all(txn.ref_count(b) == model.refs.get(b, 0) for b in range(txn.num_blocks))


@given(num_blocks=BLOCKS, data=st.data())
def test_allocate_pops_from_the_front(num_blocks: int, data: st.DataObject) -> None:
    """allocate(n) hands out the first n free blocks in queue order and leaves the rest queued."""
    pool = BlockPool.create(num_blocks)
    n = data.draw(st.integers(0, num_blocks))
    txn = pool.txn()
    assert txn.allocate(n) == list(range(n))
    after = txn.freeze()
    assert after.free_queue == tuple(range(n, num_blocks))
    assert dict(after.ref_counts.items()) == dict.fromkeys(range(n), 1)


@given(num_blocks=BLOCKS, data=st.data())
def test_release_appends_tail_first(num_blocks: int, data: st.DataObject) -> None:
    """Releasing a table appends its blocks at the back of the free queue, last block first."""
    txn = BlockPool.create(num_blocks).txn()
    table = txn.allocate(data.draw(st.integers(1, num_blocks)))
    rest = txn.freeze().free_queue
    txn = txn.freeze().txn()
    txn.release(table)
    assert txn.freeze().free_queue == rest + tuple(reversed(table))


@given(num_blocks=st.integers(2, 12), data=st.data())
def test_shared_block_is_freed_by_its_last_holder(num_blocks: int, data: st.DataObject) -> None:
    """A block shared by two tables stays referenced until both release it, then joins the queue once."""
    txn = BlockPool.create(num_blocks).txn()
    block = txn.allocate(1)[0]
    register(txn, block, 1)
    txn.share(block)
    txn.release([block])
    assert txn.ref_count(block) == 1 and block not in txn.freeze().free_queue
    txn.release([block])
    assert txn.freeze().free_queue.count(block) == 1


@given(num_blocks=BLOCKS, data=st.data())
def test_cached_free_block_is_evicted_on_reuse(num_blocks: int, data: st.DataObject) -> None:
    """A released cached block keeps its registration (lookup hits) until allocate pops it for reuse."""
    txn = BlockPool.create(num_blocks).txn()
    block = txn.allocate(1)[0]
    register(txn, block, 7)
    txn.release([block])
    pool = txn.freeze()
    assert pool.txn().lookup(7, None, (7, 7)) == block and pool.cached[block] == CachedBlock(7, None, (7, 7), 0, None)
    txn = pool.txn()
    reused = txn.allocate(pool.num_free)  # the cached block is last in the queue, so this reaches it
    assert reused[-1] == block and txn.lookup(7, None, (7, 7)) is None
    after = txn.freeze()
    assert block not in after.cached and 7 not in after.hash_to_block


@given(num_blocks=st.integers(3, 12), data=st.data())
def test_share_takes_a_free_cached_block_out_of_the_queue(num_blocks: int, data: st.DataObject) -> None:
    """Sharing a free cached block (a prefix hit) removes just that block and keeps the others' LRU order."""
    txn = BlockPool.create(num_blocks).txn()
    table = txn.allocate(3)
    for i, block in enumerate(table):
        register(txn, block, i)
    txn.release(table)
    queue = txn.freeze().free_queue
    hit = data.draw(st.sampled_from(table))
    txn = txn.freeze().txn()
    txn.share(hit)
    assert txn.freeze().free_queue == tuple(b for b in queue if b != hit)


@given(num_blocks=st.integers(3, 12), data=st.data())
def test_lookup_guard_rejects_other_tokens_or_parent(num_blocks: int, data: st.DataObject) -> None:
    """lookup returns a block only when hash and tokens match its registration and its parent is the very
    registration of the given parent block (whatever that block's hash)."""
    txn = BlockPool.create(num_blocks).txn()
    first, other, block = txn.allocate(3)
    register(txn, first, 1)
    register(txn, other, 2)
    txn.register(block, first, 5, 1, (1, 2))
    assert txn.lookup(5, first, (1, 2)) == block
    assert txn.lookup(5, other, (1, 2)) is None
    assert txn.lookup(5, None, (1, 2)) is None
    assert txn.lookup(5, first, (2, 1)) is None
    assert txn.lookup(6, first, (1, 2)) is None


@given(num_blocks=st.integers(3, 12), data=st.data())
def test_child_of_an_evicted_parent_never_matches(num_blocks: int, data: st.DataObject) -> None:
    """A parent evicted and registered again (same hash and tokens) is a new registration: the children registered
    under the old one are never hit through it; a child whose parent block is unregistered is not registered."""
    txn = BlockPool.create(num_blocks).txn()
    parent, child = txn.allocate(2)
    register(txn, parent, 1)
    txn.register(child, parent, 5, 1, (1, 2))
    txn.release([parent])
    txn.release([child])  # the queue ends parent, child: the parent is evicted first
    txn = txn.freeze().txn()
    txn.allocate(txn.num_free - 1)
    assert not txn.is_cached(parent) and txn.is_cached(child)
    register(txn, parent, 1)
    assert txn.lookup(1, None, (1, 1)) == parent and txn.lookup(5, parent, (1, 2)) is None
    orphan = txn.allocate(1)[0]  # the child, evicted
    txn.register(orphan, data.draw(st.sampled_from([orphan, num_blocks - 1])), 6, 5, (1, 2))
    assert txn.lookup(6, parent, (1, 2)) is None and not txn.is_cached(orphan)


@given(num_blocks=BLOCKS, data=st.data())
def test_pool_txn_matches_naive_model(num_blocks: int, data: st.DataObject) -> None:
    """Random allocate/release/share/register/lookup sequences match the naive pool; a frozen pool never changes
    afterwards, whether the transaction goes on or a new one is opened from it."""
    pool = BlockPool.create(num_blocks)
    model = NaivePool(num_blocks)
    txn = pool.txn()
    snapshots: list[tuple[BlockPool, bytes]] = []
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        apply_random_op(data, txn, model)
        if data.draw(st.booleans(), label="freeze"):
            pool = txn.freeze()
            assert_same(pool, model)
            snapshots.append((pool, snapshot(pool)))
            if data.draw(st.booleans(), label="reopen"):  # else the transaction goes on after freeze()
                txn = pool.txn()
    assert_same(txn.freeze(), model)
    for old, pickled in snapshots:
        assert snapshot(old) == pickled


PMAP_KEYS = st.one_of(st.integers(-50, 50), st.text(max_size=3))


@given(ops=st.lists(st.tuples(st.booleans(), PMAP_KEYS, st.integers()), max_size=60), data=st.data())
def test_pmap_behaves_like_a_dict(ops: list[tuple[bool, object, int]], data: st.DataObject) -> None:
    """Random set/delete sequences through evolvers match a dict; older PMaps stay as they were; pickles
    round-trip."""
    reference: dict[object, int] = {}
    current: PMap[object, int] = PMap()
    history: list[tuple[PMap[object, int], dict[object, int]]] = [(current, {})]
    evolver = current.evolver()
    for is_set, key, value in ops:
        if is_set:
            evolver.set(key, value)
            reference[key] = value
        elif key in reference:
            evolver.delete(key)
            del reference[key]
        assert len(evolver) == len(reference) and (key in evolver) == (key in reference)
        if data.draw(st.booleans(), label="persist"):
            current = evolver.persistent()
            history.append((current, dict(reference)))
            evolver = current.evolver()
    current = evolver.persistent()
    history.append((current, dict(reference)))
    for pmap, expected in history:
        assert dict(pmap.items()) == expected and pmap == expected and len(pmap) == len(expected)
        assert set(pmap) == set(expected) and all(pmap.get(k) == v and k in pmap for k, v in expected.items())
        assert pickle.loads(pickle.dumps(pmap)) == expected


@given(items=st.dictionaries(PMAP_KEYS, st.integers(), max_size=40))
def test_pmap_constructor_and_pickle(items: dict[object, int]) -> None:
    """PMap(items) equals items, and unpickles to an equal PMap (rebuilt from plain items)."""
    pmap = PMap(items)
    clone = pickle.loads(pickle.dumps(pmap))
    assert pmap == items and clone == items and isinstance(clone, PMap)
    assert all(clone[k] == v for k, v in items.items())


def test_kv_seam_worked_example() -> None:
    """The worked example of fnvllm/state/kv.py: a twin admitted in the same step waits for the blocks being
    computed, then hits them and computes only its last token."""
    config = CoreConfig(block_size=2, num_blocks=8, max_num_batched_tokens=8)
    a, b = (5, 6, 7, 8, 9), (5, 6, 7, 8, 1)
    kv = KVManager(BlockPool.create(config.num_blocks), config)
    prefix = kv.find_cached_prefix(a, (), len(a), ())
    assert prefix.blocks == () and prefix.num_computed == 0 and not prefix.is_pending
    table = kv.allocate_slots(prefix, len(a))
    assert table == (0, 1, 2)
    chain = kv.note_computing(a, (), (), prefix.chain, 0, len(a))
    assert chain == tuple(chain_hashes(config.hash_block, a, 2, 2))
    assert kv.find_cached_prefix(b, (), len(b), ()).is_pending  # b's first block is being computed: it waits
    assert table is not None
    kv.register_full_blocks(a, (), (), table, chain, 0, len(a))
    kv = KVManager(kv.freeze(), config)  # the next step
    prefix = kv.find_cached_prefix(b, (), len(b), ())
    assert prefix.blocks == (0, 1) and prefix.num_computed == 4 and not prefix.is_pending
    assert kv.allocate_slots(prefix, len(b)) == (0, 1, 3)
