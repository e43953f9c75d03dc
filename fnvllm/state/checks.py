"""Strict checks of user-supplied values: one validation style for every public value object.

``SamplingParams``, ``CoreConfig``, ``EngineConfig`` and requests all check their fields with these, so every
boundary behaves the same way:

- a bool is not an int and a str is not a number: nothing is coerced with ``int()`` / ``float()`` / ``str()``;
- lossless numeric normalisation only: an integer scalar of another library (numpy's ``int64``) becomes an
  ``int``, a real one (``float32``) a ``float``, so nothing downstream meets a foreign scalar type;
- NaN and infinities are outside every range;
- an error names the field, what is allowed and the value it got (its repr cut short, and never a repr that
  itself fails, such as a 10,000-digit int's), and is raised before anything changes.

Each check takes the pair of error classes to raise: (out of range, wrong type); the wrong-type class is also a
``TypeError`` (see errors.py). Imports only the standard library. Public: the shell (``EngineConfig``, ``LLM``,
the server and the simulator's inputs) validates with the same functions, so every boundary reads alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from fnvllm.state.errors import ConfigTypeError, InvalidConfigError, InvalidRequestError, RequestTypeError

Errors = tuple[type[Exception], type[Exception]]
REQUEST: Errors = (InvalidRequestError, RequestTypeError)
CONFIG: Errors = (InvalidConfigError, ConfigTypeError)

_MAX_REPR = 80
_NOT_TOKEN_SEQUENCES = (str, bytes, bytearray, memoryview, Mapping, set, frozenset)


def show(value: object) -> str:
    """``repr(value)``, cut to about 80 characters, with the type named when the repr does not make it obvious."""
    try:
        text = repr(value)
    except Exception:  # e.g. an int too long to print: repr raises ValueError
        text = f"<{type(value).__name__} that cannot be shown>"
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 5] + " ...)"
    kind = type(value)
    if kind not in (int, float, str, bool, type(None), list, tuple):
        text += (
            f" (a {kind.__module__}.{kind.__qualname__})" if kind.__module__ != "builtins" else f" (a {kind.__name__})"
        )
    return text


def fail(errors: Errors, name: str, allowed: str, value: object, *, wrong_type: bool = False) -> Exception:
    """The error for ``name`` holding ``value`` where ``allowed`` is what it must be (raise the result)."""
    return errors[1 if wrong_type else 0](f"{name} must be {allowed}, got {show(value)}")


def is_int(value: object) -> bool:
    """True for ints and integer scalars of other libraries (numpy's), False for bools."""
    kind = type(value)
    return kind is int or (kind is not bool and isinstance(value, numbers.Integral))


def is_real(value: object) -> bool:
    """True for ints, floats and real scalars of other libraries, False for bools."""
    kind = type(value)
    return kind is float or kind is int or (kind is not bool and isinstance(value, numbers.Real))


def _int_range(low: int | None, high: int | None, optional: bool) -> str:
    if low is not None and high is not None:
        text = f"an int in [{low}, {high}]"
    elif low is not None:
        text = f"an int >= {low}"
    else:
        text = "an int" if high is None else f"an int <= {high}"
    return "None or " + text if optional else text


def check_int(value: Any, name: str, errors: Errors, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int, or the error naming ``name`` and the range [low, high] (None = unbounded)."""
    return _int(value, name, errors, low, high, optional=False)


def check_optional_int(
    value: Any, name: str, errors: Errors, low: int | None = None, high: int | None = None
) -> int | None:
    """None, or ``value`` checked as by ``check_int`` (the error says None is allowed too)."""
    return None if value is None else _int(value, name, errors, low, high, optional=True)


def _int(value: Any, name: str, errors: Errors, low: int | None, high: int | None, *, optional: bool) -> int:
    if not is_int(value):
        raise fail(errors, name, _int_range(low, high, optional), value, wrong_type=True)
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise fail(errors, name, _int_range(low, high, optional), value)
    return number


def _number(x: float) -> str:
    """A range end as written by hand: 4096, 0.5, 0.001."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def check_real(
    value: Any, name: str, errors: Errors, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> float:
    """``value`` as a finite float in the interval from ``low`` to ``high`` (each end open or closed)."""
    allowed = f"a number in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"
    if not is_real(value):
        raise fail(errors, name, allowed, value, wrong_type=True)
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range is out of every range
        raise fail(errors, name, allowed, value) from None
    above = number > low if low_open else number >= low
    below = number < high if high_open else number <= high
    if not (above and below and math.isfinite(number)):
        raise fail(errors, name, allowed, value)
    return number


def check_bool(value: Any, name: str, errors: Errors) -> bool:
    """``value`` if it is a bool (True/False), else the wrong-type error: 0, 1 and "false" are not bools."""
    if type(value) is not bool:
        raise fail(errors, name, "True or False", value, wrong_type=True)
    return value


def check_str(value: Any, name: str, errors: Errors, *, non_empty: bool = True) -> str:
    """``value`` if it is a str (non-empty unless told otherwise)."""
    allowed = "a non-empty str" if non_empty else "a str"
    if not isinstance(value, str):
        raise fail(errors, name, allowed, value, wrong_type=True)
    if non_empty and not value:
        raise fail(errors, name, allowed, value)
    return value


def check_choice(value: Any, name: str, errors: Errors, choices: Sequence[str]) -> str:
    """``value`` if it is one of the str ``choices`` (compared only as a str: an array never reaches ``==``)."""
    allowed = f"one of {tuple(choices)}"
    if not isinstance(value, str):
        raise fail(errors, name, allowed, value, wrong_type=True)
    if value not in choices:
        raise fail(errors, name, allowed, value)
    return value


def _id_range(upper: int | None) -> str:
    return f"in [0, {upper})" if upper is not None else ">= 0"


def check_token_ids(values: Any, name: str, errors: Errors, upper: int | None = None) -> tuple[int, ...]:
    """``values`` as a tuple of int token ids in [0, upper) (upper None: >= 0).

    Accepted containers: tuple, list, range, any other non-text Sequence, and 1-D integer arrays (anything with
    an integer ``dtype`` and ``ndim == 1``, i.e. numpy's). Rejected: str and bytes (their items are not token
    ids), mappings and sets (a dict would be read as its keys), iterators, arrays of floats or of other ranks.
    Items must be ints or integer scalars, never bools or floats. The check is a few C-level passes over the ids
    (the types as a set, then min and max), not a Python loop per token: the simulator adds 100k requests.
    """
    container = "a sequence of int token ids (list, tuple or 1-D integer array)"
    if isinstance(values, _NOT_TOKEN_SEQUENCES):
        raise fail(errors, name, container, values, wrong_type=True)
    dtype = getattr(values, "dtype", None)
    if dtype is not None and hasattr(values, "ndim"):
        if values.ndim != 1 or getattr(dtype, "kind", None) not in ("i", "u"):
            raise fail(errors, name, container, values, wrong_type=True)
        ids = tuple(values.tolist())
    elif type(values) is tuple:
        ids = values
    elif isinstance(values, (list, range, Sequence)):
        ids = tuple(values)
    else:
        raise fail(errors, name, container, values, wrong_type=True)
    if not ids:
        return ids
    kinds = set(map(type, ids))
    if kinds != {int}:
        bad = [t for t in ids if not is_int(t)]
        if bad:
            raise errors[1](f"{name} must hold only ints (token ids {_id_range(upper)}); got {show(bad[0])}")
        ids = tuple(map(int, ids))
    if min(ids) < 0 or (upper is not None and max(ids) >= upper):
        outside = [t for t in ids if t < 0 or (upper is not None and t >= upper)]
        raise errors[0](f"{name} token ids must be ints {_id_range(upper)}; got {show(outside[:5])}")
    return ids
