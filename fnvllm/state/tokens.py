"""Generated tokens as a persistent log: appending is O(1) and shares everything already stored.

A ``TokenLog`` is either a *base*, a flat tuple of token ids (``()`` when empty), or a *cell* ``(parent, token)``
whose parent is another TokenLog. Appending builds one 2-tuple, which commit does for a whole batch in C
(``zip(parents, tokens)``) instead of one Python call per sequence. Logs are compacted back into a base every
COMPACT_EVERY steps, so a cell chain is never deeper than that (pickle and equality recurse over it).

Worked example: the base (4, 9) then appending 7 and 1 gives ((((4, 9), 7), 1)); ``flatten`` -> (4, 9, 7, 1);
``last_token`` -> 1. A base and a cell never look alike: a cell's first item is a tuple, a base's is an int.
"""

from __future__ import annotations

from typing import Any, TypeAlias

COMPACT_EVERY = 64

TokenLog: TypeAlias = tuple[Any, ...]


def is_cell(log: TokenLog) -> bool:
    """True when ``log`` is a (parent, token) cell rather than a flat base."""
    return bool(log) and isinstance(log[0], tuple)


def append_token(log: TokenLog, token: int) -> TokenLog:
    """``log`` with ``token`` appended (a new value; ``log`` is shared, not copied)."""
    return (log, token)


def flatten(log: TokenLog) -> tuple[int, ...]:
    """All tokens of the log, in order."""
    tail: list[int] = []
    push = tail.append
    while log and type(log[0]) is tuple:  # inlined is_cell: this loop runs for every compaction
        push(log[1])
        log = log[0]
    if not tail:
        return log
    tail.reverse()
    return log + tuple(tail)


def last_token(prompt: tuple[int, ...], log: TokenLog) -> int:
    """The newest known token: the last generated one, else the prompt's last."""
    return int(log[-1]) if log else prompt[-1]


def token_slice(prompt: tuple[int, ...], log: TokenLog, start: int, stop: int) -> tuple[int, ...]:
    """Tokens [start, stop) of prompt + output."""
    n = len(prompt)
    if stop <= n:
        return prompt[start:stop]
    output = flatten(log)
    if start >= n:
        return output[start - n : stop - n]
    return prompt[start:] + output[: stop - n]
