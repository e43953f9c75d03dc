"""The skinny GEMM's SiLU-and-mul epilogue (``glu_out``): a gate/up projection and its activation in one launch,
against ``silu_and_mul(F.linear(x, [gate | up]))`` under Triton's CPU interpreter at tiny, odd shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import skinny_gemm
from fnvllm.kernels.fused_ops import rmsnorm_ref, silu_and_mul, silu_and_mul_ref
from fnvllm.kernels.skinny_gemm import FUSED_TIMES, Fused, SkinnyConfig, norm_mlp, prefers_fused, skinny_linear

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


def _mlp_inputs(rows: int, k: int, inter: int, n: int) -> tuple[torch.Tensor, ...]:
    """x, residual (rows, K), the norm weight (K,), [gate | up] (2I, K) and down (N, I), float32."""
    gen = torch.Generator().manual_seed(rows + k + inter)
    x, res = torch.randn(rows, k, generator=gen), torch.randn(rows, k, generator=gen)
    nw = torch.rand(k, generator=gen) + 0.5
    gu, down = torch.randn(2 * inter, k, generator=gen) / k**0.5, torch.randn(n, inter, generator=gen) / inter**0.5
    return tuple(t.to(DEVICE) for t in (x, res, nw, gu, down))


def _mlp_ref(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, gu: torch.Tensor, down: torch.Tensor):
    """The reference: rmsnorm(x + res), the gate/up projection, silu_and_mul, the down projection."""
    h = x if res is None else x + res
    return F.linear(silu_and_mul_ref(F.linear(rmsnorm_ref(h, nw, 1e-6), gu)), down), h


def test_norm_mlp_takes_the_glu_epilogue_only_where_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a FUSED_TIMES "glu" entry faster than the two launches (and on a "GPU": the interpreter here) the
    activation runs in gate/up's epilogue (one glu_out launch), otherwise the unfused ops; both give the reference,
    with and without a residual."""
    rows, k, inter, n = 3, 64, 48, 40
    x, res, nw, gu, down = _mlp_inputs(rows, k, inter, n)
    calls: list[bool] = []
    real = skinny_gemm.skinny_linear

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(bool(kwargs.get("glu_out")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    monkeypatch.setattr(skinny_gemm, "skinny_linear", recording)
    cfg = SkinnyConfig(16, 32, 64, 1)
    for fused_us, want in ((4.0, True), (9.0, False)):
        monkeypatch.setitem(FUSED_TIMES, ("glu", 2 * inter, k, 16), Fused(cfg, fused_us, 6.0))
        for residual in (res, None):
            calls.clear()
            y, new_res = norm_mlp(x, residual, nw, 1e-6, gu, None, down)
            ref, ref_res = _mlp_ref(x, residual, nw, gu, down)
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(new_res, ref_res)
            assert (True in calls) == want, f"fused_us={fused_us}: launches {calls}"
    assert not prefers_fused("glu", 1, 2 * inter, k) and not prefers_fused("glu", 65, 2 * inter, k)


def test_model_with_the_glu_epilogue_matches_torch_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 whose gate/up projections run the SiLU-and-mul epilogue at decode rows (a measured-faster entry
    planted for its shape) gives the torch-ops logits through prefill chunks and decodes."""
    from test_fused_layer import CHUNKS, run

    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS, triton_ops
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    key = ("glu", 2 * config.intermediate_size, config.hidden_size, 1)
    monkeypatch.setitem(FUSED_TIMES, key, Fused(SkinnyConfig(1, 8, 64, 1, use_dot=False), 1.0, 2.0))
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    assert ours.model.layers[0].mlp.fuses_norm_mlp()
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(
        run(ours, tokens.to(DEVICE), False), run(ref, tokens.to(DEVICE), False), atol=1e-4, rtol=1e-4
    )
