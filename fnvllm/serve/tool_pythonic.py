"""Reading the pythonic tool-call format (Llama 3.2 / Llama 4): a Python list of calls,
``[get_weather(city="Paris", unit="c"), get_time()]``, whose keyword arguments are Python literals (str, int,
float, bool, None, lists, dicts with str keys). ``ListScanner`` finds where such a list closes as the text
streams in; ``read_calls`` reads a closed one with ``ast``, never evaluating anything: any other expression is no
call.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

# "[", then a function name and "(" (blanks allowed between): a prefix of this may still open a call list
_HEAD = re.compile(r"\s*\[\s*(?:([A-Za-z_]\w*)\s*)?")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_SIGNIFICANT = re.compile(r"[\"'()\[\]{}\\\n]")  # what moves a bracket scan: quotes, brackets, escapes, line ends


class _NotLiteral(ValueError):
    """An argument that is not a JSON-representable Python literal."""


class ListScanner:
    """Finds where a call list that opens a text closes (``list_len``), reading on from where its last call stopped
    when the text extends the last one (a stream's growing block): a long list costs one pass, not one per delta.
    Any other text starts a fresh scan, so the answer never depends on what came before."""

    def __init__(self) -> None:
        self._text = ""  # the text the scan below has read; "" when none
        self._read = 0  # how much of it the bracket scan has read
        self._closers: list[str] = []  # the closing brackets owed, innermost last
        self._quote: str | None = None  # the quote of the string the scan is in
        self._escaped = -1  # the index of the character after a backslash in a string

    def list_len(self, text: str) -> int | None:
        """The length of the call list that opens ``text`` (after blanks): through its closing "]", or through
        the first character that shows it is not a call list (no name and "(" after "[", a closing bracket that
        does not match, a string running past its line); None while it is open. A prefix of the text never gives
        another answer than the whole text (the decision at each character reads only what comes before it)."""
        head = _HEAD.match(text)
        assert head is not None  # every part of the pattern may be empty but "[", which the parser saw
        at = head.end()
        if at == len(text):
            return None
        if head.group(1) is None or text[at] != "(":
            return at + 1
        if not self._text or not text.startswith(self._text):
            self._read, self._closers, self._quote, self._escaped = text.index("["), [], None, -1
        self._text = text
        return self._scan(text)

    def _scan(self, text: str) -> int | None:
        """Read on from where the scan stopped, skipping quoted strings (with backslash escapes)."""
        for found in _SIGNIFICANT.finditer(text, self._read):
            at, char = found.start(), found.group()
            if at == self._escaped:
                continue
            if self._quote is not None:
                if char == "\\":
                    self._escaped = at + 1
                elif char == self._quote:
                    self._quote = None
                elif char == "\n":
                    return at + 1
            elif char in "\"'":
                self._quote = char
            elif char in _CLOSERS:
                self._closers.append(_CLOSERS[char])
            elif char in ")]}" and (char != self._closers.pop() or not self._closers):  # a mismatch, or closed
                self._text = ""  # the scan is over: the next text starts afresh
                return at + 1
        self._read = len(text)
        return None


def list_len(text: str) -> int | None:
    """``ListScanner.list_len`` of a fresh scanner: where the call list that opens ``text`` closes."""
    return ListScanner().list_len(text)


def read_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, arguments) of each call in a Python list of calls (at least one), or None when ``text`` is not
    one: each item a call of a plain name with keyword arguments only (no repeats, no ``**``), each argument a
    literal that JSON can hold (finite numbers, str without lone surrogates, lists, dicts with str keys)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_read_call(node) for node in tree.body.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # _NotLiteral is a ValueError
        return None


def _read_call(node: ast.expr) -> tuple[str, dict[str, Any]]:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotLiteral("not a call of a name with keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            raise _NotLiteral("**arguments, or an argument given twice")
        arguments[keyword.arg] = _value(keyword.value)
    return node.func.id, arguments


def _value(node: ast.expr) -> Any:
    """The JSON-representable literal ``node`` spells (a leading sign on a number included)."""
    if isinstance(node, ast.Constant):
        return _constant(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = _value(node.operand)
        if type(number) not in (int, float):  # bool is an int: -True is no literal
            raise _NotLiteral("a sign before a non-number")
        return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.List):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_value(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise _NotLiteral("a dict key that is not a str")
        return dict(zip(keys, [_value(value) for value in node.values], strict=True))
    raise _NotLiteral(f"{type(node).__name__} is not a literal")


def _constant(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, str):
        value.encode("utf-8")  # a lone surrogate ("\ud83d") raises UnicodeEncodeError, a ValueError
        return value
    raise _NotLiteral(f"{value!r} is not a JSON value")
