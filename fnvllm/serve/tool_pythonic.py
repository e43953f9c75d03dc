"""Reading the pythonic tool-call format (Llama 3.2 / Llama 4): a Python list of calls,
``[get_weather(city="Paris", unit="c"), get_time()]``, whose keyword arguments are Python literals (str, int,
float, bool, None, lists, dicts with str keys). ``list_len`` finds where such a list closes as the text streams
in; ``read_calls`` reads a closed one with ``ast``, never evaluating anything: any other expression is no call.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

# "[", then a function name and "(" (blanks allowed between): a prefix of this may still open a call list
_HEAD = re.compile(r"\s*\[\s*(?:([A-Za-z_]\w*)\s*)?")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class _NotLiteral(ValueError):
    """An argument that is not a JSON-representable Python literal."""


def list_len(text: str) -> int | None:
    """The length of the call list that opens ``text`` (after blanks): through its closing "]", or through the
    first character that shows it is not a call list (no name and "(" after "[", a closing bracket that does not
    match, a string running past the line); None while it is open. A prefix of the text never gives another
    answer than the whole text (the decision at each character reads only what comes before it)."""
    head = _HEAD.match(text)
    assert head is not None  # every part of the pattern may be empty but "[", which the parser saw
    at = head.end()
    if at == len(text):
        return None
    if head.group(1) is None or text[at] != "(":
        return at + 1
    return _bracket_end(text, text.index("["))


def _bracket_end(text: str, start: int) -> int | None:
    """The end of the bracket opened at ``text[start]``, skipping quoted strings (with backslash escapes); the
    end of the first mismatched closer or unclosed string line; None while it is open."""
    closers: list[str] = []
    quote: str | None = None
    at = start
    while at < len(text):
        char = text[at]
        if quote is not None:
            if char == "\\":
                at += 1
            elif char == quote:
                quote = None
            elif char == "\n":
                return at + 1
        elif char in "\"'":
            quote = char
        elif char in _CLOSERS:
            closers.append(_CLOSERS[char])
        elif char in ")]}" and (char != closers.pop() or not closers):  # a mismatch, or the list closed
            return at + 1
        at += 1
    return None


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
