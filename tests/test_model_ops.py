"""The model's small-op implementations compute the same functions as the torch references."""

from __future__ import annotations

import pytest
import torch

from fnvllm.model.ops import TORCH_OPS, ModelOps, ops_for


def _implementations() -> list[ModelOps]:
    """Every ModelOps this machine can run besides the reference (Triton only under the interpreter or CUDA)."""
    found = []
    for name in ("triton",):
        try:
            found.append(ops_for(name))
        except ImportError:
            continue
    return found


@pytest.mark.parametrize("ops", _implementations(), ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_match_reference(ops: ModelOps, dtype: torch.dtype) -> None:
    """rmsnorm, add+rmsnorm, rotary, norm+rotary and silu-and-mul of an implementation equal the torch reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and ops.name == "triton":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton ops need CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).to(device, dtype)
    res = torch.randn(7, 64, generator=gen).to(device, dtype)
    w = torch.randn(64, generator=gen).to(device, dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6), TORCH_OPS.rmsnorm(x, w, 1e-6), **tol)
    for got, want in zip(ops.add_rmsnorm(x, res, w, 1e-6), TORCH_OPS.add_rmsnorm(x, res, w, 1e-6), strict=True):
        torch.testing.assert_close(got, want, **tol)
    q = torch.randn(7, 4, 32, generator=gen).to(device, dtype)
    angles = torch.rand(7, 16, generator=gen).to(device) * 6
    torch.testing.assert_close(
        ops.rotary(q, angles.cos(), angles.sin()), TORCH_OPS.rotary(q, angles.cos(), angles.sin()), **tol
    )
    qkv = torch.randn(7, 8, 32, generator=gen).to(device, dtype)
    head_w = torch.randn(32, generator=gen).to(device, dtype)
    for view, weight in ((qkv[:, :4], head_w), (qkv[:, 4:6], head_w), (q, None)):  # strided q/k views of a qkv
        torch.testing.assert_close(
            ops.norm_rotary(view, weight, 1e-6, angles.cos(), angles.sin()),
            TORCH_OPS.norm_rotary(view, weight, 1e-6, angles.cos(), angles.sin()),
            **tol,
        )
    gu = torch.randn(7, 128, generator=gen).to(device, dtype)
    torch.testing.assert_close(ops.silu_and_mul(gu), TORCH_OPS.silu_and_mul(gu), **tol)


def test_unknown_ops_name_is_rejected() -> None:
    """An unknown implementation name is a ValueError listing the choices."""
    with pytest.raises(ValueError, match="torch"):
        ops_for("cudnn")
