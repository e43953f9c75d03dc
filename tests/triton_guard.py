"""The guard every Triton kernel test module starts with: run the kernels in Triton's interpreter when there is no
CUDA device, and skip the module, with the reason shown, when that cannot work."""

from __future__ import annotations

import os

import pytest
import torch


def require_triton() -> str:
    """The device the module's kernels run on ("cuda", or "cpu" under TRITON_INTERPRET=1); skips the calling module
    when triton is missing, or was imported before the interpreter could be switched on. Call it before importing
    any fnvllm.kernels module (their @triton.jit decorators read TRITON_INTERPRET when they run)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    language = pytest.importorskip("triton.language", reason="triton is not importable: Triton kernel tests skipped")
    if not torch.cuda.is_available() and type(language.zeros).__name__ != "InterpretedFunction":
        pytest.skip(
            "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set (run with TRITON_INTERPRET=1)",
            allow_module_level=True,
        )
    return "cuda" if torch.cuda.is_available() else "cpu"
