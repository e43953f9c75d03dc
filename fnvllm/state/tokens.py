"""Generated tokens as a tuple of fixed-size chunks, so appending costs O(chunk + n/chunk), not O(n).

``Chunks`` is a plain tuple of tuples: every chunk but the last holds exactly CHUNK tokens; the last holds
1..CHUNK tokens; an empty output is ``()``. Example with CHUNK=4: 6 tokens -> ((1, 2, 3, 4), (5, 6)).
"""

from __future__ import annotations

from itertools import chain

CHUNK = 64

Chunks = tuple[tuple[int, ...], ...]


def append_token(chunks: Chunks, token: int) -> Chunks:
    """``chunks`` with ``token`` appended (a new value; ``chunks`` is untouched)."""
    if chunks and len(chunks[-1]) < CHUNK:
        return (*chunks[:-1], (*chunks[-1], token))
    return (*chunks, (token,))


def flatten(chunks: Chunks) -> tuple[int, ...]:
    """All tokens in order."""
    if len(chunks) == 1:
        return chunks[0]
    return tuple(chain.from_iterable(chunks))


def last_token(prompt: tuple[int, ...], chunks: Chunks) -> int:
    """The newest known token: the last generated one, else the prompt's last."""
    return chunks[-1][-1] if chunks else prompt[-1]


def token_slice(prompt: tuple[int, ...], chunks: Chunks, start: int, stop: int) -> tuple[int, ...]:
    """Tokens [start, stop) of prompt + output."""
    n = len(prompt)
    if stop <= n:
        return prompt[start:stop]
    out_start, out_stop = max(start - n, 0), stop - n
    first, last = out_start // CHUNK, (out_stop - 1) // CHUNK
    pieces = chunks[first : last + 1]
    flat = pieces[0] if len(pieces) == 1 else tuple(chain.from_iterable(pieces))
    offset = first * CHUNK
    tail = flat[out_start - offset : out_stop - offset]
    return prompt[start:] + tail if start < n else tail
