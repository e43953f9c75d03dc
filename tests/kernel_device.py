"""Where a sampler test runs the Triton kernels: the GPU where there is one, else the CPU under the interpreter."""

from __future__ import annotations

import os

import pytest
import torch


def kernel_device(kernels: bool) -> str:
    """The device for a test of the torch references (``kernels`` False: the CPU) or of the Triton kernels (the
    GPU where there is one, else the CPU with TRITON_INTERPRET=1; skipped without Triton or the interpreter)."""
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    if kernels:
        pytest.importorskip("triton", reason="the kernel path needs Triton")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    return device
