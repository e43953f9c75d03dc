"""Running-sequence columns: tuples aligned with ``EngineState.running``, and ``RowMap`` to read them by id.

Every step changes the progress of every running sequence (tokens computed, length, output). Kept in dicts
keyed by request id, each step would copy several dicts and update them entry by entry. Kept instead as tuples
aligned with ``running`` (row i describes ``running[i]``), a decode step rewrites a whole column with one C-level
``map``/``zip``, and columns that did not change are shared with the previous state as they are.

Worked example: running ("b", "a") with b at 9 computed tokens and a at 4 is the column (9, 4); a step where both
decode makes it (10, 5) with one ``map(add, ...)``; "a" finishing makes it (10,).

``RowMap`` presents one such column, plus a persistent map for the live requests that are not running, as an
ordinary read-only ``Mapping`` keyed by request id, so readers (tests, the shell) never see the layout.

Private representation (docs/design.md, "State representation").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from fnvllm.state._pmap import PMap

V = TypeVar("V")
T = TypeVar("T")


class RowMap(Mapping[str, V], Generic[V]):
    """An immutable mapping stored in two parts: ``row_values`` aligned with the id tuple ``row_ids`` (the running
    sequences) and the persistent map ``rest`` (live requests that are not running; a PMap, so that admitting or
    adding one request copies one small shard, not every waiting entry). The two parts never share a key.

    ``row_values`` may be given as a function that computes them on first use (``RowMap.derived``), for a column
    that the scheduler keeps in another form and that only readers need. Lookups by id merge the two parts into
    one dict on first use. Both are caches: not part of the value, never pickled, never changing what it holds.
    """

    __slots__ = ("_make_rows", "_merged", "_rows", "rest", "row_ids")

    row_ids: tuple[str, ...]
    rest: PMap[str, V]
    _rows: tuple[V, ...] | None
    _make_rows: Callable[[], tuple[V, ...]] | None
    _merged: dict[str, V] | None

    def __init__(self, row_ids: tuple[str, ...], row_values: tuple[V, ...], rest: PMap[str, V]) -> None:
        self.row_ids = row_ids
        self.rest = rest
        self._rows = row_values
        self._make_rows = None
        self._merged = None

    @classmethod
    def empty(cls) -> RowMap[V]:
        """A mapping with no rows and nothing else."""
        return cls((), (), PMap())

    @classmethod
    def derived(cls, row_ids: tuple[str, ...], make_rows: Callable[[], tuple[V, ...]], rest: PMap[str, V]) -> RowMap[V]:
        """A mapping whose row values are ``make_rows()``, computed when first read."""
        new: RowMap[V] = cls(row_ids, (), rest)
        new._rows, new._make_rows = None, make_rows
        return new

    @property
    def row_values(self) -> tuple[V, ...]:
        """The values aligned with ``row_ids``."""
        rows = self._rows
        if rows is None:
            assert self._make_rows is not None
            rows = self._rows = self._make_rows()
        return rows

    def with_rows(self, row_ids: tuple[str, ...], row_values: tuple[V, ...]) -> RowMap[V]:
        """The same ``rest`` with new rows (shares ``rest``; returns ``self`` when nothing changed)."""
        if row_ids is self.row_ids and row_values is self._rows:
            return self
        return RowMap(row_ids, row_values, self.rest)

    def with_rest(self, rest: PMap[str, V]) -> RowMap[V]:
        """The same rows with a new ``rest``."""
        if self._rows is None:
            assert self._make_rows is not None
            return RowMap.derived(self.row_ids, self._make_rows, rest)
        return RowMap(self.row_ids, self._rows, rest)

    def as_dict(self) -> dict[str, V]:
        """Both parts as one dict (cached; do not mutate it)."""
        merged = self._merged
        if merged is None:
            merged = self.rest.as_dict()
            merged.update(zip(self.row_ids, self.row_values, strict=True))
            self._merged = merged
        return merged

    def __getitem__(self, key: str) -> V:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.rest) + len(self.row_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.as_dict() == (other.as_dict() if isinstance(other, RowMap) else dict(other.items()))

    def __hash__(self) -> int:
        raise TypeError("RowMap is unhashable (its values may be unhashable)")

    def __repr__(self) -> str:
        return f"RowMap({self.as_dict()!r})"

    def __reduce__(self) -> tuple[type[RowMap[V]], tuple[tuple[str, ...], tuple[V, ...], PMap[str, V]]]:
        return (RowMap, (self.row_ids, self.row_values, self.rest))


def drop_rows(column: tuple[T, ...], indices: Sequence[int]) -> tuple[T, ...]:
    """``column`` without the rows at ``indices`` (ascending). ``del`` on a list copy is a C memmove per row, far
    cheaper than filtering every row through an iterator."""
    if not indices:
        return column
    if len(indices) == 1:
        return column[: indices[0]] + column[indices[0] + 1 :]
    rows = list(column)
    for index in reversed(indices):
        del rows[index]
    return tuple(rows)


def insert_rows(column: tuple[T, ...], positions: Sequence[int], values: Sequence[T]) -> tuple[T, ...]:
    """``column`` with ``values[j]`` inserted at ``positions[j]``, in order (each position counts the rows inserted
    before it). Appends at the end, the common case under FCFS, are one tuple concatenation."""
    if not positions:
        return column
    if all(p == len(column) + j for j, p in enumerate(positions)):
        return column + tuple(values)
    rows = list(column)
    for position, value in zip(positions, values, strict=True):
        rows.insert(position, value)
    return tuple(rows)


def zero_positions(values: list[int]) -> list[int]:
    """Indices of the zeros in ``values``, found by C-level ``count`` and ``index`` scans (zeros are rare here)."""
    found: list[int] = []
    start = 0
    for _ in range(values.count(0)):
        start = values.index(0, start) + 1
        found.append(start - 1)
    return found


def byte_positions(data: bytes, value: int) -> list[int]:
    """Indices of ``value`` in ``data``, found by C-level ``count`` and ``find`` (memchr) scans."""
    found: list[int] = []
    start = 0
    for _ in range(data.count(value)):
        start = data.find(value, start) + 1
        found.append(start - 1)
    return found
