"""tests/_interpreter_speed.py: Triton's interpreter with its builtin walk cached computes what it computed before,
and leaves triton.language as it found it."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import triton
import triton.language as tl

interpreting = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _plus_one(x):
    return _scaled(x, 2.0) + 1.0  # a helper calling a helper: two nested device calls per program


@triton.jit
def _nested_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, tl.maximum(_plus_one(x), 0.0), mask=mask)


def _builtin_names(module: object) -> tuple[str, ...]:
    return tuple(name for name, member in inspect.getmembers(module) if tl.core.is_builtin(member))


@interpreting
def test_the_cached_walk_is_installed_and_lists_every_builtin() -> None:
    from triton.runtime import interpreter

    names = getattr(interpreter._patch_builtin, "builtin_names", None)
    assert names is not None, "tests/conftest.py did not install the cached walk"
    assert tl.tensor in names and tl in names and tl.math in names
    for module, cached in names.items():  # outside a launch every module is unpatched: the cache matches a walk
        assert cached == _builtin_names(module), module
        assert cached, module


@interpreting
def test_kernels_with_nested_helpers_compute_the_torch_values_and_restore_the_language() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    before = {name: getattr(tl, name) for name in _builtin_names(tl)}
    _nested_kernel[(3,)](x, out, x.numel(), BLOCK=128)
    torch.testing.assert_close(out, (x * 2 + 1).clamp(min=0), rtol=0, atol=0)
    assert {name: getattr(tl, name) for name in _builtin_names(tl)} == before  # every builtin put back
