"""Row-group FP8 weights (quantization="fp8" on a 16/32-bit checkpoint) and the row-wise GEMM: the row-group
scales, the (1, N) row scale the loader and the dummy fill give each linear, the per-token activation quantization
kernel against its reference (Triton's CPU interpreter), the FNVLLM_FP8_ROWWISE switch, and on a GPU the row-wise
``_scaled_mm`` path against float32 and bf16 products.

Planted-bug check (done by hand when this file was written): ``quant.row_scales`` with ``.repeat(128)`` in place
of ``.repeat_interleave(128)`` (row r taking the scale of block r % blocks instead of block r // 128) fails
test_row_scale_applies_per_row and test_loaded_row_scales_match_the_block_scales."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fnvllm.kernels import fp8_gemm as g
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.quant import quantize_fp8_row_groups, row_scales
from fnvllm.testing.checkpoints import write_fp8_checkpoint, write_tiny_checkpoint

# As tests/test_fp8_weights.py: hidden 320 ends K of qkv / gate_up on a partial block; the fused parts (q 512, k and
# v 256 rows; gate and up 512) start on 128-row boundaries.
SHAPE: dict[str, Any] = dict(
    hidden_size=320, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=256, num_layers=2
)
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _rows_by_block(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 (n, k) weight whose 128-row blocks differ in magnitude by 10x each (1, 10, 100, ...)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return w * (10.0 ** (torch.arange(n) // 128)).float()[:, None]


def test_row_group_scales_are_equal_across_k_and_round_trip() -> None:
    """quantize_fp8_row_groups gives the block layout (ceil(N / 128), ceil(K / 128)) with every row block's scales
    equal to its amax over all K / 448 (an all-zero block harmless), and dequantizes within e4m3's error (1/16
    relative, or half a subnormal step)."""
    w = _rows_by_block(300, 200)
    w[128:256] = 0.0
    q, scale = quantize_fp8_row_groups(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (300, 200) and tuple(scale.shape) == (3, 2)
    assert torch.equal(scale[:, 0], scale[:, 1])
    assert scale[0, 0] == w[:128].abs().max() / 448 and scale[2, 0] == w[256:].abs().max() / 448
    back = g.dequantize_fp8_blocks(q, scale, torch.float32)
    assert back[128:256].eq(0).all()
    bound = g.expand_block_scales(scale, 300, 200) * 2**-10 + w.abs() / 16
    assert ((back - w).abs() <= bound).all()


def test_row_scale_applies_per_row() -> None:
    """row_scales repeats each row block's scale over its own 128 rows (the last block cut), so the weight times
    its row scale equals the block-scale dequantization and the original weight within e4m3 error."""
    w = _rows_by_block(300, 200, seed=1)
    q, scale = quantize_fp8_row_groups(w)
    rows = row_scales(scale, 300)
    assert tuple(rows.shape) == (1, 300) and rows.dtype == torch.float32
    assert rows[0, 127] == scale[0, 0] and rows[0, 128] == scale[1, 0] and rows[0, 299] == scale[2, 0]
    by_row = q.float() * rows.T
    torch.testing.assert_close(by_row, g.dequantize_fp8_blocks(q, scale, torch.float32), rtol=0, atol=0)
    assert ((by_row - w).abs() <= rows.T * 2**-10 + w.abs() / 16).all()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Qwen3 checkpoint."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rowwise") / "src", "qwen3", **SHAPE)


def _fp8_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's FP8 linears by name."""
    return {name: m for name, m in model.named_modules() if getattr(m, "weight_scale_inv", None) is not None}


def test_loaded_row_scales_match_the_block_scales(checkpoint: Path) -> None:
    """quantization="fp8" quantizes each stored part of a linear in row groups (fused parts one by one), and every
    FP8 linear carries the (1, N) float32 row scale of its block scales; the same holds for dummy weights."""
    stored = load_file(checkpoint / "model.safetensors")
    config = ModelConfig.from_pretrained(checkpoint, quantization="fp8")
    model = load_model(checkpoint, config, "cpu")
    linears = _fp8_linears(model)
    assert len(linears) == 4 * SHAPE["num_layers"]
    for name, linear in linears.items():
        n = linear.weight.shape[0]
        assert tuple(linear.weight_row_scale.shape) == (1, n) and linear.weight_row_scale.dtype == torch.float32
        assert torch.equal(linear.weight_row_scale, row_scales(linear.weight_scale_inv, n))
        prefix, _, leaf = name.rpartition(".")
        start = 0
        for part in PARTS.get(leaf, (leaf,)):
            q, scale = quantize_fp8_row_groups(stored[f"{prefix}.{part}.weight"])
            end = start + q.shape[0]
            assert torch.equal(linear.weight[start:end].float(), q.float()), f"{name} rows of {part}"
            assert torch.equal(linear.weight_row_scale[0, start:end], row_scales(scale, q.shape[0])[0])
            start = end
    dummy = load_model(checkpoint, config, "cpu", load_format="dummy")
    for linear in _fp8_linears(dummy).values():
        assert torch.equal(linear.weight_row_scale, row_scales(linear.weight_scale_inv, linear.weight.shape[0]))
        assert bool((linear.weight_row_scale > 0).all())


def test_official_fp8_checkpoint_has_no_row_scale(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint in the official 128 x 128 block layout keeps its stored scales and no row scale (None), and the
    row scale is not part of the state dict."""
    fp8 = write_fp8_checkpoint(checkpoint, tmp_path / "fp8")
    model = load_model(fp8, ModelConfig.from_pretrained(fp8), "cpu")
    linears = _fp8_linears(model)
    assert linears and all(linear.weight_row_scale is None for linear in linears.values())
    on_load = load_model(checkpoint, ModelConfig.from_pretrained(checkpoint, quantization="fp8"), "cpu")
    assert not any(key.endswith("weight_row_scale") for key in on_load.state_dict())


@pytest.mark.parametrize(("m", "k", "block_k"), [(5, 300, None), (3, 300, 64), (17, 128, None)])
def test_per_token_quantization_kernel_matches_reference(m: int, k: int, block_k: int | None) -> None:
    """quantize_per_token (one tile per row, or two passes of block_k columns) gives the reference's per-token
    scales, e4m3 values within half a step of x / scale (rounding ties may differ), an all-zero row the minimum
    scale, and zero padding rows up to a multiple of 16."""
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    x[1] = 0.0
    x_q, x_scale = g.quantize_per_token(x, pad_rows=16, block_k=block_k)
    ref_q, ref_scale = g.quantize_per_token_ref(x)
    rows = -(-m // 16) * 16
    assert tuple(x_q.shape) == (rows, k) and tuple(x_scale.shape) == (rows, 1)
    torch.testing.assert_close(x_scale[:m], ref_scale)
    assert x_scale[1, 0] == g.MIN_SCALE and x_q[1].float().eq(0).all()
    exact = x.float() / x_scale[:m]
    assert ((x_q[:m].float() - exact).abs() <= exact.abs() / 16 + 2**-10).all()
    assert (x_q[:m].float() == ref_q.float()).float().mean() > 0.97
    assert x_q[m:].float().eq(0).all() and x_scale[m:].eq(g.MIN_SCALE).all()


def test_per_token_quantization_refuses_bad_arguments() -> None:
    """A 1-D input, pad_rows < 1 and a block_k that is not a power of two >= 16 are ValueErrors naming them."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        g.quantize_per_token(x[0])
    with pytest.raises(ValueError, match="pad_rows"):
        g.quantize_per_token(x, pad_rows=0)
    with pytest.raises(ValueError, match="block_k"):
        g.quantize_per_token(x, block_k=48)


def test_rowwise_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """FNVLLM_FP8_ROWWISE: unset or "1" is on, "0" off, anything else a ValueError naming the variable."""
    monkeypatch.delenv(g.ROWWISE_ENV, raising=False)
    assert g._rowwise_from_env()
    monkeypatch.setenv(g.ROWWISE_ENV, "0")
    assert not g._rowwise_from_env()
    monkeypatch.setenv(g.ROWWISE_ENV, "yes")
    with pytest.raises(ValueError, match=g.ROWWISE_ENV):
        g._rowwise_from_env()


def test_rowwise_threshold_is_per_weight_shape() -> None:
    """rowwise_min_m gives a weight shape's measured entry (Qwen3-8B's qkv) and ROWWISE_MIN_M for the others."""
    assert g.rowwise_min_m(6144, 4096) == g.ROWWISE_MIN_M_BY_SHAPE[(6144, 4096)] < g.ROWWISE_MIN_M
    assert g.rowwise_min_m(4096, 12288) == g.ROWWISE_MIN_M


def test_rowwise_mm_refuses_a_bad_row_scale() -> None:
    """fp8_rowwise_mm names row_scale when it is not (1, N) float32."""
    w = torch.zeros(32, 64, dtype=g.FP8_DTYPE)
    with pytest.raises(ValueError, match="row_scale"):
        g.fp8_rowwise_mm(torch.zeros(4, 64, dtype=torch.bfloat16), w, torch.ones(32, 1))


# ---- on a GPU ---------------------------------------------------------------------------------------------------


def _gpu_operands(m: int, n: int = 384, k: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x (m, k) bf16, e4m3 w (n, k), its block scales, its row scale) on the GPU, skipping without the recipe."""
    if not g._has_rowwise_scaled_mm(0):
        pytest.skip("torch._scaled_mm has no row-wise recipe on this GPU / build")
    w = _rows_by_block(n, k, seed=2).cuda() / 50
    q, scale = quantize_fp8_row_groups(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    return x, q, scale, row_scales(scale, n)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [65, 256, 1000])
def test_rowwise_gemm_matches_float32_of_the_same_operands(m: int) -> None:
    """fp8_rowwise_mm computes the float32 product of its per-token quantized activations and the row-scaled
    weight (relative error < 1e-2), M padded and cut back."""
    x, w, _, rows = _gpu_operands(m)
    x_q, x_scale = g.quantize_per_token(x)
    exact = g.fp8_rowwise_ref(x_q, x_scale, w, rows, torch.float32)
    out = g.fp8_rowwise_mm(x, w, rows)
    assert tuple(out.shape) == (m, 384) and out.dtype == torch.bfloat16
    assert float((out.float() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [65, 256, 1000])
def test_fp8_linear_takes_the_rowwise_path_within_fp8_error(m: int) -> None:
    """fp8_linear with a row scale takes the row-wise GEMM above rowwise_min_m tokens and stays within FP8
    activation error of bf16 F.linear on the dequantized weight (relative error < 5e-2), with the bias added."""
    x, w, scale, rows = _gpu_operands(m)
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    assert g.takes_rowwise(m, x, w) == (m > g.rowwise_min_m(384, 512) and g.ROWWISE)
    out = g.fp8_linear(x, w, scale, bias, row_scale=rows)
    ref = F.linear(x, g.dequantize_fp8_blocks(w, scale, torch.bfloat16), bias)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 5e-2


@pytest.mark.gpu
@needs_cuda
def test_rowwise_path_captures_in_a_cuda_graph() -> None:
    """The row-wise path (quantization kernel + _scaled_mm) captures in a CUDA graph and its replay equals the
    eager result on new inputs copied into the same buffer."""
    x, w, scale, rows = _gpu_operands(256)
    g.fp8_linear(x, w, scale, row_scale=rows)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.fp8_linear(x, w, scale, row_scale=rows)
    graph.replay()
    before = out.clone()
    x.copy_(torch.randn_like(x))
    graph.replay()
    eager = g.fp8_linear(x, w, scale, row_scale=rows)
    assert not torch.equal(eager, before)  # the new inputs give a different product
    torch.testing.assert_close(out, eager)
