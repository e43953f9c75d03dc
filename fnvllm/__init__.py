"""fnvllm: LLM inference whose scheduler and KV-block manager are pure functions.

``from fnvllm import LLM, SamplingParams`` for offline generation; ``fnvllm.state`` for the pure core (which
imports no torch, so this package imports nothing heavy until ``LLM`` or ``Engine`` is touched).
"""

from __future__ import annotations

from typing import Any

from fnvllm.state import SamplingParams, StructuredOutput

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutput",
]

_BEAM = "fnvllm.engine.beam"
_LAZY = {
    "LLM": "fnvllm.llm",
    "BeamSearchOutput": _BEAM,
    "BeamSearchParams": _BEAM,
    "BeamSearchSequence": _BEAM,
    "Engine": "fnvllm.engine",
    "EngineConfig": "fnvllm.config",
}


def __getattr__(name: str) -> Any:
    """Import the torch-backed names on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fnvllm' has no attribute {name!r}")
