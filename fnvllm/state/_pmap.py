"""PMap: a small persistent (copy-on-write) mapping for the block pool's large tables.

A frozen state cannot mutate a dict in place, and copying a 4,000-entry dict for every registered block would
cost more than the whole step. PMap splits the entries over 64 shard dicts; an update copies only the shards it
touches. Updates go through an ``Evolver`` (one per transition) that copies each touched shard once, so a step
that changes k entries pays O(k + touched shards * shard size), not O(total).

Keys are shard-addressed by ``hash(key)``. Pickling stores plain items, so a map pickled in one process (with
its own string-hash seed) is rebuilt correctly in another.

Private representation (docs/design.md, "State representation"); ``fnvllm.testing.invariants.check_derived``
checks every map's length counter and shard placement after every rule of the state machine.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_SHARD_BITS = 6
_NUM_SHARDS = 1 << _SHARD_BITS
_SHARD_MASK = _NUM_SHARDS - 1
_EMPTY_SHARDS: tuple[dict[object, object], ...] = tuple({} for _ in range(_NUM_SHARDS))


class PMap(Mapping[K, V], Generic[K, V]):
    """An immutable mapping with cheap functional updates via ``evolver()``. Never mutated after construction."""

    __slots__ = ("_len", "_shards")

    _shards: tuple[dict[K, V], ...]
    _len: int

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        shards: list[dict[K, V]] = [{} for _ in range(_NUM_SHARDS)]
        for key, value in (items or {}).items():
            shards[hash(key) & _SHARD_MASK][key] = value
        self._shards = tuple(shards)
        self._len = sum(len(s) for s in shards)

    @classmethod
    def _from_shards(cls, shards: tuple[dict[K, V], ...], length: int) -> PMap[K, V]:
        new = cls.__new__(cls)
        new._shards = shards
        new._len = length
        return new

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) & _SHARD_MASK][key]

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) & _SHARD_MASK]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        return self._shards[hash(key) & _SHARD_MASK].get(key, default)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        for shard in self._shards:
            yield from shard

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and all(k in other and other[k] == v for k, v in self.items())

    def __hash__(self) -> int:
        raise TypeError("PMap is unhashable (its values may be unhashable)")

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"

    def __reduce__(self) -> tuple[type[PMap[K, V]], tuple[dict[K, V]]]:
        return (PMap, (self.as_dict(),))

    def evolver(self) -> Evolver[K, V]:
        """A scratch copy for one transition's updates; ``persistent()`` freezes it into a new PMap."""
        return Evolver(self)

    def updated(self, items: Iterable[tuple[K, V]]) -> PMap[K, V]:
        """A new map with ``items`` inserted or replaced."""
        evolver = self.evolver()
        for key, value in items:
            evolver.set(key, value)
        return evolver.persistent()

    def without(self, keys: Iterable[K]) -> PMap[K, V]:
        """A new map without ``keys`` (absent keys are ignored)."""
        evolver = self.evolver()
        for key in keys:
            if key in evolver:
                evolver.delete(key)
        return evolver.persistent()

    def as_dict(self) -> dict[K, V]:
        """The entries as a plain dict (merged shard by shard in C)."""
        merged: dict[K, V] = {}
        for shard in self._shards:
            merged.update(shard)
        return merged


class Evolver(Generic[K, V]):
    """Batched updates of a PMap. Local to one transition; the source PMap is never touched.

    The shard list is copied on the first write only, so an evolver that is merely read (most steps) costs
    nothing to open, and ``persistent()`` then returns the source itself.
    """

    __slots__ = ("_copied", "_len", "_shards", "_source")

    def __init__(self, source: PMap[K, V]) -> None:
        self._source = source
        self._shards: tuple[dict[K, V], ...] | list[dict[K, V]] = source._shards
        self._copied: set[int] | None = None  # the shards this evolver owns; None until the first write
        self._len = source._len

    def _writable(self, key: K) -> dict[K, V]:
        index = hash(key) & _SHARD_MASK
        copied = self._copied
        if copied is None:
            self._shards = list(self._shards)
            copied = self._copied = set()
        elif index in copied:
            return self._shards[index]
        copied.add(index)
        shard = self._shards[index] = dict(self._shards[index])  # type: ignore[index]
        return shard

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) & _SHARD_MASK][key]

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) & _SHARD_MASK]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._shards[hash(key) & _SHARD_MASK].get(key, default)

    def __len__(self) -> int:
        return self._len

    def set(self, key: K, value: V) -> None:
        """Insert or replace ``key``."""
        shard = self._writable(key)
        if key not in shard:
            self._len += 1
        shard[key] = value

    def delete(self, key: K) -> None:
        """Remove ``key`` (KeyError when absent)."""
        del self._writable(key)[key]
        self._len -= 1

    def persistent(self) -> PMap[K, V]:
        """Freeze into a PMap. Later writes copy their shards again, so the returned map never changes."""
        if self._copied is None:
            return self._source
        self._source = PMap._from_shards(tuple(self._shards), self._len)
        self._shards, self._copied = self._source._shards, None
        return self._source
