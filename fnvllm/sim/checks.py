"""Checks of the simulator's inputs: specs, profiles, model shapes, traces, grids, timelines.

The same strict style as the engine's (``fnvllm.state.checks``): no coercion (``"fast"`` is not a number, a bool
is not an int), NaN and infinities outside every range, and an error that names the field, the allowed range and
the value, raised before anything is built. Every size has an upper end, so an absurd value fails here instead of
as a MemoryError (or a silent nonsense result) later. ``SimInputError`` is a ValueError (``SimInputTypeError``
also a TypeError), so the CLI turns either into one line and exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fnvllm.state.checks import check_bool, check_int, check_optional_int, check_real, check_str, fail, is_real
from fnvllm.state.config import MAX_MODEL_LEN, MAX_NUM_BLOCKS

__all__ = [
    "MAX_MODEL_LEN",
    "MAX_NUM_BLOCKS",
    "MAX_POINTS",
    "MAX_REQUESTS",
    "SimInputError",
    "SimInputTypeError",
    "check_bool_field",
    "check_count",
    "check_mapping",
    "check_optional_count",
    "check_positive",
    "check_rate",
    "check_real_in",
    "check_text",
]

MAX_REQUESTS = 10_000_000  # a workload's requests (each costs ~100 bytes until it arrives)
MAX_POINTS = 10_000  # points of one sweep grid


class SimInputError(ValueError):
    """A simulator input out of its range (a spec option, a profile or model field, a trace or timeline line)."""


class SimInputTypeError(SimInputError, TypeError):
    """A simulator input of the wrong type (a string where a number belongs, a bool where an int does)."""


SIM = (SimInputError, SimInputTypeError)


def check_count(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high], else SimInputError naming ``name``."""
    return check_int(value, name, SIM, low, high)


def check_optional_count(value: Any, name: str, low: int, high: int) -> int | None:
    """None, or ``value`` checked as by ``check_count``."""
    return check_optional_int(value, name, SIM, low, high)


def check_real_in(value: Any, name: str, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] (``low_open``: (low, high])."""
    return check_real(value, name, SIM, low, high, low_open=low_open)


def check_positive(value: Any, name: str, high: float) -> float:
    """``value`` as a finite float in (0, high]: a bandwidth, a rate, a memory size."""
    return check_real(value, name, SIM, 0.0, high, low_open=True)


def check_rate(value: Any, name: str, high: float) -> float:
    """A positive rate that may also be infinite (inf = everything at once)."""
    if is_real(value) and math.isinf(value) and value > 0:
        return math.inf
    if is_real(value) and not math.isnan(value) and value > high:
        raise fail(SIM, name, f"a number in (0, {high:g}] or inf", value)
    try:
        return check_positive(value, name, high)
    except SimInputError:
        raise fail(SIM, name, f"a number in (0, {high:g}] or inf", value, wrong_type=not is_real(value)) from None


def check_bool_field(value: Any, name: str) -> bool:
    """``value`` if it is True or False."""
    return check_bool(value, name, SIM)


def check_text(value: Any, name: str, *, non_empty: bool = True) -> str:
    """``value`` if it is a str (non-empty unless told otherwise)."""
    return check_str(value, name, SIM, non_empty=non_empty)


def check_mapping(value: Any, name: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping with str keys (a JSON object, a YAML mapping)."""
    if not isinstance(value, Mapping):
        raise fail(SIM, name, "a mapping of names to values", value, wrong_type=True)
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise fail(SIM, f"{name} keys", "str", bad[0], wrong_type=True)
    return value
