"""Logprobs kept as one step's flat host arrays, each row's ``TokenLogprobs`` built only when it is read.

Why (issue 19, ``--logprobs 5`` at 256 rows): building 256 ``TokenLogprobs`` (each with a tuple of n (id, logprob)
pairs) every step and keeping them in the request trackers cost the host more than the sampling itself. The
building is a few hundred microseconds; the larger part was the garbage collector: every retained
``TokenLogprobs`` is a tracked object, so the young generation filled every few hundred rows and full collections
walked the whole growing heap (on the CPU, 256 rows x 600 steps: ~3 ms of collection per step against ~0.05 ms
when a step keeps only a reference to its arrays and each row its index; ``benchmarks/host_step.py --logprobs 5``).

So a step's logprobs are one ``StepLogprobs`` (three flat numpy arrays: no per-row objects), the engine's per-request
view of a step is ``RequestLogprobs`` (a mapping built lazily over it), and a request's history is a
``LogprobList`` holding, per token, the step's ``RequestLogprobs`` itself: the output loop appends that one shared
object to each tracker (one list append per row; no row is found, built or wrapped while the loop runs). The
request's row in each step is found, and its ``TokenLogprobs`` built, only when the entries are read: a finished
request's ``RequestOutput.logprobs`` is a ``LogprobView`` that builds all of them in bulk on first read (measured
on the CPU, ``benchmarks/host_step.py --output-path 1000``: building every entry when requests finished cost ~0.6
ms per step of the loop at 256 rows; a caller that never reads them, like the throughput bench, now pays nothing,
one that reads them pays it when reading). Readers see sequences of ``TokenLogprobs`` as before: a view compares,
hashes, prints and pickles as the tuple of its entries.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import compress, repeat
from typing import TYPE_CHECKING, overload

import numpy as np

from fnvllm.executor.base import TokenLogprobs

if TYPE_CHECKING:  # the engine (and the simulator, which imports no torch) use this module without tensors
    import torch


class StepLogprobs(Sequence["TokenLogprobs | None"]):
    """One step's logprobs per sampled row (plan order): a ``TokenLogprobs``, or None where the row did not ask.

    Holds the rows that asked as flat numpy arrays: ``sampled[k]`` the sampled token's logprob of the k-th such row,
    ``ids`` / ``values`` its ``width`` best (id, logprob) from ``k * width``, best first. A row that asked for
    n < width keeps its first n. ``places[i]``: row i's k, or None (did not ask); None for the whole tuple when
    every row asked for ``width`` (k == i). Compares equal to the tuple of its entries. From ``from_host`` the
    arrays are views of rows ``_base`` on of an arena ``_Block`` shared with other steps (read in bulk per request).
    """

    __slots__ = ("_asked", "_base", "_block", "_ids", "_places", "_sampled", "_tokens", "_values", "_width")

    def __init__(
        self,
        tokens: Sequence[int],
        asked: Sequence[int | None],
        sampled: np.ndarray,
        ids: np.ndarray,
        values: np.ndarray,
        width: int,
        places: Sequence[int | None] | None = None,
    ) -> None:
        if len(tokens) != len(asked):
            raise ValueError(f"tokens and asked must have one entry per sampled row, got {len(tokens)}, {len(asked)}")
        self._tokens, self._asked, self._width = tokens, asked, width
        self._sampled, self._ids, self._values = sampled, ids, values
        if places is None and (len(sampled) != len(asked) or asked.count(width) != len(asked)):
            k = iter(range(len(sampled)))
            places = tuple(None if n is None else next(k) for n in asked)
        self._places = places
        self._block: _Block | None = None  # with from_host: the arena block the arrays view, from row _base
        self._base = 0

    @classmethod
    def from_host(
        cls, tokens: Sequence[int], asked: Sequence[int | None], sampled: torch.Tensor, top_ids: torch.Tensor,
        top_values: torch.Tensor,
    ) -> StepLogprobs:  # fmt: skip
        """From the host copies of the sampler's ``Logprobs`` ((L,), (L, n), (L, n) of the L rows that asked),
        copied into the next L rows of this thread's arena block of width n (the tensors' pinned buffers are
        reused): rows of many steps side by side, so that a request's rows across its steps are gathered by one
        numpy index per block when read (``_build_rows``), and no per-step arrays are allocated."""
        width = top_ids.shape[1] if top_ids.dim() == 2 else 0
        num_rows = sampled.shape[0]
        block, base = _take(width, num_rows)
        end = base + num_rows
        block.sampled[base:end] = sampled.numpy()
        block.ids[base:end] = top_ids.numpy().reshape(num_rows, width)
        block.values[base:end] = top_values.numpy().reshape(num_rows, width)
        step = cls(
            tokens, asked, block.sampled[base:end], block.ids[base:end].reshape(-1),
            block.values[base:end].reshape(-1), width,
        )  # fmt: skip
        step._block, step._base = block, base
        return step

    def __len__(self) -> int:
        return len(self._asked)

    @overload
    def __getitem__(self, i: int) -> TokenLogprobs | None: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[TokenLogprobs | None, ...]: ...

    def __getitem__(self, i: int | slice) -> TokenLogprobs | tuple[TokenLogprobs | None, ...] | None:
        if isinstance(i, slice):
            return tuple(map(self.entry, range(len(self))[i]))
        return self.entry(range(len(self))[i])

    def entry(self, row: int) -> TokenLogprobs | None:
        """Row ``row``'s TokenLogprobs (0 <= row < len), built now, or None when it did not ask."""
        n = self._asked[row]
        if n is None:
            return None
        k = row if self._places is None else self._places[row]
        assert k is not None  # a row that asked has a place
        at = k * self._width
        ids, values = self._ids[at : at + n].tolist(), self._values[at : at + n].tolist()
        return TokenLogprobs(self._tokens[row], float(self._sampled[k]), tuple(zip(ids, values, strict=True)))

    @property
    def every_row_asked(self) -> bool:
        """True when every row asked for the same count (row i's entries are the i-th of the arrays)."""
        return self._places is None

    def asked(self, row: int) -> bool:
        """True when row ``row`` asked for logprobs."""
        return self._asked[row] is not None

    def __iter__(self) -> Iterator[TokenLogprobs | None]:
        if self._places is not None:
            return map(self.entry, range(len(self)))
        width, ids, values = self._width, self._ids.tolist(), self._values.tolist()
        starts = range(0, len(ids), width) if width else repeat(0, len(self))
        tops = (tuple(zip(ids[at : at + width], values[at : at + width], strict=False)) for at in starts)
        return map(TokenLogprobs, self._tokens, self._sampled.tolist(), tops)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # compares by value, like the tuple it stands for

    def __repr__(self) -> str:
        return f"StepLogprobs({tuple(self)!r})"

    def select(self, keep: Sequence[bool]) -> StepLogprobs:
        """The rows flagged in ``keep`` (one flag per row), sharing this step's arrays."""
        if len(keep) != len(self):
            raise ValueError(f"keep must have one flag per row ({len(self)}), got {len(keep)}")
        places = range(len(self)) if self._places is None else self._places
        chosen = StepLogprobs(
            tuple(compress(self._tokens, keep)),
            tuple(compress(self._asked, keep)),
            self._sampled,
            self._ids,
            self._values,
            self._width,
            tuple(compress(places, keep)),
        )
        chosen._block, chosen._base = self._block, self._base
        return chosen


class RequestLogprobs(Mapping[str, TokenLogprobs]):
    """One step's logprobs by request id: the rows of ``step`` (``seq_ids``, in the same order) that asked. Each
    value is built when read; ``reference`` hands out the (step, row) instead, for a ``LogprobList``."""

    __slots__ = ("_index", "_seq_ids", "_step")

    def __init__(self, seq_ids: Sequence[str], step: StepLogprobs) -> None:
        if len(seq_ids) != len(step):
            raise ValueError(f"seq_ids must name every row of the step ({len(step)}), got {len(seq_ids)}")
        self._seq_ids, self._step = seq_ids, step
        self._index: dict[str, int] | None = None

    def _rows(self) -> dict[str, int]:
        """Request id -> row, of the rows that asked (built on first use)."""
        if self._index is None:
            step = self._step
            if step.every_row_asked:  # the common case: one C-level pass
                self._index = dict(zip(self._seq_ids, range(len(step)), strict=True))
            else:
                self._index = {rid: i for i, rid in enumerate(self._seq_ids) if step.asked(i)}
        return self._index

    def reference(self, request_id: str) -> tuple[StepLogprobs, int] | None:
        """(step, row) of ``request_id``'s logprobs, or None when it has none this step."""
        row = self._rows().get(request_id)
        return None if row is None else (self._step, row)

    def __getitem__(self, request_id: str) -> TokenLogprobs:
        entry = self._step.entry(self._rows()[request_id])
        assert entry is not None  # only rows that asked are in the index
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())

    def __repr__(self) -> str:
        return f"RequestLogprobs({dict(self)!r})"


class LogprobList(Sequence[TokenLogprobs]):
    """A request's logprobs, one per generated token: each entry is a ``TokenLogprobs`` given as it is, or the
    step's ``RequestLogprobs``, in which this request's row is found when the entry is read. Appending costs one
    list append per token (no per-token object, nothing for the garbage collector to walk); entries are built on
    first read and kept from then on (``materialize``). ``view`` hands out a read-only prefix (``LogprobView``:
    what ``RequestOutput.logprobs`` holds), built only if someone reads it."""

    __slots__ = ("_built", "_sources", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._sources: list[TokenLogprobs | RequestLogprobs] = []
        self._built: list[TokenLogprobs] = []  # the first len(_built) entries, built

    def append(self, logprobs: TokenLogprobs | RequestLogprobs) -> None:
        """Add one entry: a TokenLogprobs as it is, or a step's ``RequestLogprobs`` (which holds this request's
        row), to be built when read."""
        self._sources.append(logprobs)

    def __len__(self) -> int:
        return len(self._sources)

    def _entry(self, i: int) -> TokenLogprobs:
        if i < len(self._built):
            return self._built[i]
        source = self._sources[i]
        if isinstance(source, TokenLogprobs):
            return source
        return source[self.request_id]

    @overload
    def __getitem__(self, i: int) -> TokenLogprobs: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[TokenLogprobs, ...]: ...

    def __getitem__(self, i: int | slice) -> TokenLogprobs | tuple[TokenLogprobs, ...]:
        if isinstance(i, slice):
            rows = range(len(self))[i]
            if rows.step == 1 and rows.start <= len(self._built):  # the entries after those built (a server's
                self.build(rows.stop)  # newest, step after step): built, kept, their steps no longer referenced
                return tuple(self._built[rows.start : rows.stop])
            return tuple(map(self._entry, rows))
        return self._entry(range(len(self))[i])

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return iter(self.materialize())

    def build(self, count: int | None = None) -> None:
        """Build the first ``count`` entries (default: all) that are not built yet, and drop their references
        (which then no longer keep their steps' arrays alive)."""
        stop = len(self._sources) if count is None else min(count, len(self._sources))
        start = len(self._built)
        if start < stop:
            with _collector_paused():
                new = _build_entries(self._sources[start:stop], self.request_id)
            self._built.extend(new)
            self._sources[start:stop] = new

    def materialize(self) -> tuple[TokenLogprobs, ...]:
        """Every entry, built once (later calls build only the entries added since)."""
        self.build()
        return tuple(self._built)

    def view(self) -> LogprobView:
        """The entries so far, read-only (later appends do not show), built when first read."""
        return LogprobView(self, len(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LogprobList({tuple(self)!r})"


class LogprobView(Sequence[TokenLogprobs]):
    """The first ``count`` entries of a request's ``LogprobList``, as an immutable sequence of ``TokenLogprobs``
    (``RequestOutput.logprobs``). Nothing is built until it is read; the first read builds every entry (in bulk,
    about a third of the time of one by one) and keeps the tuple. It compares, hashes, prints and pickles as that
    tuple (a pickled view loads as a plain tuple)."""

    __slots__ = ("_count", "_entries", "_source")

    def __init__(self, source: LogprobList, count: int) -> None:
        if not 0 <= count <= len(source):
            raise ValueError(f"count must be in [0, {len(source)}] (the list's length), got {count}")
        self._source: LogprobList | None = source
        self._count = count
        self._entries: tuple[TokenLogprobs, ...] | None = None

    def entries(self) -> tuple[TokenLogprobs, ...]:
        """Every entry, as a tuple (built on the first call, then kept; the list is then no longer referenced)."""
        if self._entries is None:
            assert self._source is not None  # dropped only once the entries are built
            self._source.build(self._count)
            self._entries = tuple(self._source._built[: self._count])
            self._source = None
        return self._entries

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> TokenLogprobs: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[TokenLogprobs, ...]: ...

    def __getitem__(self, i: int | slice) -> TokenLogprobs | tuple[TokenLogprobs, ...]:
        return self.entries()[i]

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return iter(self.entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LogprobView):
            other = other.entries()
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and self.entries() == tuple(other)

    def __hash__(self) -> int:
        return hash(self.entries())

    def __repr__(self) -> str:
        return repr(self.entries())

    def __reduce__(self) -> tuple[type, tuple[tuple[TokenLogprobs, ...]]]:
        return tuple, (self.entries(),)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector off while a request's entries are built (~7 tracked objects each): with it on, the
    young generation filled every ~100 entries and, as the built entries piled up, full collections walked the
    whole heap again and again (on the CPU, reading 256 requests' 142,510 entries: 10.4 us each with it on, 2.3
    with it paused per request, ``benchmarks/host_step.py --output-path 1000``). Nothing built here is garbage."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_entries(sources: Sequence[TokenLogprobs | RequestLogprobs], request_id: str) -> list[TokenLogprobs]:
    """The entries of ``sources`` for ``request_id``: given ones as they are, each run of step references built
    together (``_build_rows``). Raises KeyError when a step holds no row of ``request_id``."""
    out: list[TokenLogprobs] = []
    steps: list[StepLogprobs] = []
    rows: list[int] = []
    for source in sources:
        if isinstance(source, TokenLogprobs):
            out.extend(_build_run(steps, rows))
            steps, rows = [], []
            out.append(source)
            continue
        row = source._rows().get(request_id)
        if row is None:
            raise KeyError(f"request {request_id!r} has no logprobs in this step (it did not ask for them)")
        steps.append(source._step)
        rows.append(row)
    out.extend(_build_run(steps, rows))
    return out


def _build_run(steps: Sequence[StepLogprobs], rows: Sequence[int]) -> list[TokenLogprobs]:
    """The entries of (step, row) references: in bulk when there are many and they asked for the same count,
    else one by one (a bulk build's few numpy calls cost more than a handful of rows built alone)."""
    built = _build_rows(steps, rows) if len(steps) >= BULK_MIN_ROWS else None
    if built is not None:
        return built
    entries = [step.entry(row) for step, row in zip(steps, rows, strict=True)]
    assert None not in entries  # references are only taken to rows that asked
    return entries  # type: ignore[return-value]


def _build_rows(steps: Sequence[StepLogprobs], rows: Sequence[int]) -> list[TokenLogprobs] | None:
    """The entries of (step, row) references that all asked for the same n (one request's) from arena blocks
    (``StepLogprobs.from_host``), built together: one pass finds each row's place in its block, one numpy index
    per block gathers them, and C-level maps build the entries. None when the rows' counts differ or a step has
    no block (then each is built alone, ``StepLogprobs.entry``)."""
    tokens: list[int] = []
    places: list[int] = []
    blocks: list[tuple[_Block, int]] = []  # each block and the entry its run starts at
    count = None
    for step, row in zip(steps, rows, strict=True):
        n, block = step._asked[row], step._block
        if n is None or block is None or (count is not None and n != count):
            return None
        count = n
        k = row if step._places is None else step._places[row]
        assert k is not None  # a row that asked has a place
        if not blocks or blocks[-1][0] is not block:
            blocks.append((block, len(places)))
        tokens.append(step._tokens[row])
        places.append(step._base + k)
    if count is None:
        return []
    at = np.array(places, dtype=np.intp)
    ends = [start for _, start in blocks[1:]] + [len(places)]
    runs = [(block, at[start:end]) for (block, start), end in zip(blocks, ends, strict=True)]
    logprobs = np.concatenate([block.sampled[index] for block, index in runs]).tolist()
    if count == 0:
        return list(map(TokenLogprobs, tokens, logprobs, repeat(())))
    flat_ids = np.concatenate([block.ids[index, :count] for block, index in runs], axis=None).tolist()
    flat_values = np.concatenate([block.values[index, :count] for block, index in runs], axis=None).tolist()
    tops = zip(*[iter(zip(flat_ids, flat_values, strict=True))] * count, strict=True)  # ((id, logprob), ...) a row
    return list(map(TokenLogprobs, tokens, logprobs, tops))


BULK_MIN_ROWS = 16  # fewer rows than this are built one by one (``_build_run``)
BLOCK_BYTES = 1 << 22  # an arena block's size: 4 MiB, ~65,000 rows of width 5 (~250 steps of 256 rows)


class _Block:
    """Rows of logprobs of one width, filled step after step (``_take``): sampled (R,) float32, ids (R, width)
    int64 and values (R, width) float32. Lives as long as a step that views it."""

    __slots__ = ("ids", "sampled", "used", "values")

    def __init__(self, num_rows: int, width: int) -> None:
        self.sampled = np.empty(num_rows, dtype=np.float32)
        self.ids = np.empty((num_rows, width), dtype=np.int64)
        self.values = np.empty((num_rows, width), dtype=np.float32)
        self.used = 0


_arena = threading.local()  # per thread (each engine loop its own): width -> the block being filled


def _take(width: int, num_rows: int) -> tuple[_Block, int]:
    """The next ``num_rows`` free rows of this thread's block of ``width`` (a fresh block when it is full)."""
    blocks: dict[int, _Block] | None = getattr(_arena, "blocks", None)
    if blocks is None:
        blocks = _arena.blocks = {}
    block = blocks.get(width)
    if block is None or block.used + num_rows > block.sampled.shape[0]:
        block = blocks[width] = _Block(max(num_rows, BLOCK_BYTES // (4 + 12 * width)), width)
    base = block.used
    block.used += num_rows
    return block, base
