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
    # every builtin a walk finds now is listed (Triton itself can leave some patched after a launch: a helper that
    # sees tl.core where its kernel saw only tl patches it and nothing undoes that, so a walk may find fewer)
    for module, cached in names.items():
        assert set(_builtin_names(module)) <= set(cached), module
    assert {"load", "store", "arange", "dot", "where"} <= set(names[tl])
    assert {"to", "__add__"} <= set(names[tl.tensor]) and {"exp", "sqrt"} <= set(names[tl.math])


@triton.jit
def _failing_kernel(x_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(x_ptr + tl.arange(0, BLOCK), _plus_one(x) + tl.zeros((2 * BLOCK,), tl.float32))  # shapes differ


@interpreting
def test_kernels_with_nested_helpers_compute_the_torch_values_and_restore_the_language() -> None:
    """Helpers inside a launch skip the repeated patching (counted), the values are exact, and after a launch (a
    failing one too) the language holds its builtins again and no launch is recorded as running."""
    from triton.runtime import interpreter

    real = interpreter._patch_lang
    launch = real.launch  # type: ignore[attr-defined]
    calls: list[object] = []

    def counted(fn: object) -> object:
        calls.append(real(fn))
        return calls[-1]

    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    before = {name: getattr(tl, name) for name in _builtin_names(tl)}
    try:
        interpreter._patch_lang = counted
        _nested_kernel[(3,)](x, out, x.numel(), BLOCK=128)
    finally:
        interpreter._patch_lang = real
    torch.testing.assert_close(out, (x * 2 + 1).clamp(min=0), rtol=0, atol=0)
    assert len(calls) == 1 + 3 * 2  # the launch, then two helpers in each of three programs
    assert all(type(scope)().__dict__ == scope.__dict__ for scope in calls[1:])  # the helpers' scopes: empty
    assert {name: getattr(tl, name) for name in _builtin_names(tl)} == before  # every builtin put back
    assert launch == {"running": False, "patched": None}
    with pytest.raises(Exception):  # noqa: B017 (the interpreter's error type varies by version)
        _failing_kernel[(1,)](x, BLOCK=16)
    assert {name: getattr(tl, name) for name in _builtin_names(tl)} == before
    assert launch == {"running": False, "patched": None}
