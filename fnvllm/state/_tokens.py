"""Generated tokens of a running sequence as *chunks* plus a *tail*, so appending is cheap column-wise.

``chunks`` is a tuple of non-empty token tuples, ``tail`` one token tuple: the output is chunks[0] + chunks[1] +
... + tail. A decode step appends every running sequence's token at once, in C, with
``map(add, tails, one_token_tuples)``: each tail is copied, but it stays short, because whenever a sequence's
length reaches a compaction point (at most COMPACT_EVERY tokens apart, see ``compaction_period`` in commit.py)
its tail becomes one more chunk. Old chunks are shared, never copied again: re-copying the whole output would
touch hundreds of scattered int objects per sequence, and walking a linked list of one cell per token costs a
Python iteration per token.

Worked example: chunks ((4, 9),), tail (7,); appending 1 gives tail (7, 1); compacting gives chunks
((4, 9), (7, 1)) and tail (); ``join`` -> (4, 9, 7, 1); ``last_token`` -> 1.

Waiting requests keep their output as one flat tuple (``join``); admission turns it back into chunks.

Private representation (docs/design.md, "State representation").
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate, chain
from typing import TypeAlias

COMPACT_EVERY = 32

Chunks: TypeAlias = tuple[tuple[int, ...], ...]


def as_chunks(output: tuple[int, ...]) -> Chunks:
    """A flat output as chunks (one chunk, or none when empty)."""
    return (output,) if output else ()


def join(chunks: Chunks, tail: tuple[int, ...]) -> tuple[int, ...]:
    """All generated tokens, flat."""
    if not chunks:
        return tail
    if len(chunks) == 1 and not tail:
        return chunks[0]
    return tuple(chain(chain.from_iterable(chunks), tail))


def compact(chunks: Chunks, tail: tuple[int, ...]) -> Chunks:
    """The chunks with the tail appended as one more chunk (the old chunks are shared)."""
    return (*chunks, tail) if tail else chunks


def last_token(prompt: tuple[int, ...], chunks: Chunks, tail: tuple[int, ...]) -> int:
    """The newest known token: the last generated one, else the prompt's last."""
    if tail:
        return tail[-1]
    return chunks[-1][-1] if chunks else prompt[-1]


def token_slice(
    prompt: tuple[int, ...], chunks: Chunks, tail: tuple[int, ...], start: int, stop: int
) -> tuple[int, ...]:
    """Tokens [start, stop) of prompt + output. Only the pieces overlapping the range are visited and copied (a
    block being registered is usually the last few chunks of a long output)."""
    n = len(prompt)
    if stop <= n:
        return prompt[start:stop]
    pieces = (*chunks, tail)
    offsets = list(accumulate(map(len, pieces), initial=n))  # offsets[j]: position of piece j's first token
    parts: list[tuple[int, ...]] = [prompt[start:]] if start < n else []
    first = max(bisect_right(offsets, start) - 1, 0)
    for j in range(first, bisect_left(offsets, stop, first)):
        parts.append(pieces[j][max(start - offsets[j], 0) : stop - offsets[j]])
    return parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))
