"""Environment variables read as settings: one parser for on/off switches and one for named choices, so every
FNVLLM_* variable refuses a value it does not take with a ValueError that names the variable and what it takes.

Every variable the package reads is listed, with its default and what it changes, in docs/environment.md (a test
keeps the two in step). They are A/B switches for measurements and debugging aids; the defaults are what was
measured fastest or is safest, and the engine's options (``EngineConfig``, the CLI) are the supported way to
configure a run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def env_switch(name: str, default: bool) -> bool:
    """Environment variable ``name`` read as an on/off switch: "1" on, "0" off, unset ``default``; anything else is
    a ValueError naming the variable."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """Environment variable ``name`` read as one of ``choices`` (unset: ``default``); anything else is a ValueError
    naming the variable and the choices.

    >>> env_choice("FNVLLM_UNSET_EXAMPLE", ("auto", "token", "head"), "auto")
    'auto'
    """
    if default not in choices:
        raise ValueError(f"{name}'s default {default!r} is not one of {tuple(choices)}")
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
