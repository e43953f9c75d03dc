"""The skinny GEMM's SiLU-and-mul epilogue (``glu_out``): a gate/up projection and its activation in one launch,
against ``silu_and_mul(F.linear(x, [gate | up]))`` under Triton's CPU interpreter at tiny, odd shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels.fused_ops import silu_and_mul, silu_and_mul_ref
from fnvllm.kernels.skinny_gemm import SkinnyConfig, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, I, K): one row, odd widths leaving partial column blocks and K tails, a full 16-row block.
SHAPES = ((1, 24, 40), (3, 50, 300), (16, 32, 256), (5, 17, 520))
CONFIGS = (
    SkinnyConfig(16, 32, 32, 1),
    SkinnyConfig(16, 32, 32, 4),  # split K, summed in-kernel, then the epilogue
    SkinnyConfig(16, 64, 64, 3, num_stages=1, preload=True),
    SkinnyConfig(16, 8, 64, 2, use_dot=False),  # CUDA cores, 4 gate + 4 up rows per program
    SkinnyConfig(16, 16, 512, 1, use_dot=False, num_stages=1, preload=True),  # one tile per program
)


def _inputs(m: int, inter: int, k: int, dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, ...]:
    """x (M, K), the [gate | up] weight (2I, K) and an optional bias (2I,), seeded by the shape."""
    gen = torch.Generator().manual_seed(m * 1000 + inter + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(2 * inter, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(2 * inter, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_float32_glu_epilogue_matches_reference(shape: tuple[int, int, int], config: SkinnyConfig) -> None:
    """In float32 every launch shape gives silu_and_mul of F.linear's product (bias included) to rounding."""
    m, inter, k = shape
    x, w, b = _inputs(m, inter, k, torch.float32, bias=True)
    got = skinny_linear(x, w, b, config, glu_out=True)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, silu_and_mul_ref(F.linear(x, w, b)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_glu_epilogue_rounds_like_the_two_launches(shape: tuple[int, int, int]) -> None:
    """In bf16 the epilogue rounds gate and up to bf16 first, as the projection's output is, then applies the
    activation as ``silu_and_mul`` does: within one bf16 unit of the unfused pair."""
    m, inter, k = shape
    x, w, _ = _inputs(m, inter, k, torch.bfloat16, bias=False)
    cfg = SkinnyConfig(16, 32, 64, 2)
    unfused = silu_and_mul(skinny_linear(x, w, config=cfg)).float()
    got = skinny_linear(x, w, config=cfg, glu_out=True).float()
    assert (got - unfused).abs().max().item() <= unfused.abs().max().item() * 2**-7


def test_glu_epilogue_rejects_configs_it_cannot_run() -> None:
    """Odd weight rows, an odd or (with tl.dot) too narrow block_n, the separate sum kernel and a GLU prologue
    as well are errors naming the problem."""
    x, w, _ = _inputs(2, 16, 64, torch.float32, bias=False)
    with pytest.raises(ValueError, match="even"):
        skinny_linear(x, w[:31], config=SkinnyConfig(16, 32, 32, 1), glu_out=True)
    with pytest.raises(ValueError, match="block_n"):
        skinny_linear(x, w, config=SkinnyConfig(16, 16, 32, 1), glu_out=True)
    with pytest.raises(ValueError, match="fused_reduce"):
        skinny_linear(x, w, config=SkinnyConfig(16, 32, 32, 2, fused_reduce=False), glu_out=True)
    with pytest.raises(ValueError, match="both"):
        skinny_linear(torch.cat([x, x], 1), w, config=SkinnyConfig(16, 32, 32, 1), glu=True, glu_out=True)
