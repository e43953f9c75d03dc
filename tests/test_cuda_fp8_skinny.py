"""The few-row FP8 CUDA projections (``fnvllm.kernels.cuda_fp8_skinny``): their table and shape checks anywhere, the
source compiled by nvcc where one is installed, and on a GPU their results against ``fp8_blockwise_ref``, the
in-kernel quantization against ``quantize_activations`` bit for bit, ``fp8_linear``'s dispatch and CUDA graphs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fnvllm.kernels import cuda_fp8_skinny as c
from fnvllm.kernels import cuda_skinny
from fnvllm.model.quant import quantize_fp8_blocks

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ CUDA GPU"
)
# (N, K, p): each kernel's p at a small shape, and the table's Qwen3-8B o_proj
SHAPES = [(256, 1024, 1), (384, 2048, 2), (4096, 4096, 4)]


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight (n, k) and its 128 x 128 block scales, rows scaled by U(0, 1) so the blocks' scales differ."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    w_q, scale = quantize_fp8_blocks(w)
    return w_q.cuda(), scale.cuda()


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """bf16 activations whose 128-column groups differ in magnitude (so their scales do)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 128, generator=gen).repeat_interleave(128, dim=1) * 4
    return x.cuda().to(torch.bfloat16)


@pytest.mark.parametrize(("shape", "cfg"), list(c.FP8_CONFIGS.items()))
def test_every_entry_spans_k_with_a_kernel(shape: tuple[int, int], cfg: c.Fp8Config) -> None:
    """Each entry covers K exactly (8 warps x 128 x p), whole 128-row scale blocks of N, and names kernels that
    SOURCE instantiates."""
    n, k = shape
    assert k == c.PER_GROUP_DEPTH * cfg.p and n % 128 == 0 and cfg.quant_rows <= c.QUANT_MAX_ROWS
    for quant in (False, True):
        assert f"FP8_SKINNY({cfg.p}, {str(quant).lower()}, {c.kernel_name(cfg.p, quant)})" in c.SOURCE


def test_every_p_is_instantiated_both_ways() -> None:
    """SOURCE defines exactly the (p, quantizing) kernels the module can name."""
    found = set(re.findall(r"^FP8_SKINNY\((\d), (true|false), (\w+)\)$", c.SOURCE, flags=re.M))
    assert found == {(str(p), q, c.kernel_name(p, q == "true")) for p in c.PS for q in ("true", "false")}


def test_no_config_off_the_gpu_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors never take the kernel; neither does anything with cuda_skinny switched off."""
    w = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    assert c.fp8_config(x, w, torch.ones(32, 32)) is None
    monkeypatch.setattr(cuda_skinny, "ENABLED", False)
    assert c.fp8_config(x, w, torch.ones(32, 32)) is None


@pytest.mark.parametrize(
    ("m", "k", "dtype", "quant", "match"),
    [
        (4, 3000, torch.float8_e4m3fn, False, "K = 1024"),  # K not 1024 p
        (17, 4096, torch.float8_e4m3fn, False, "1-16 rows"),  # past one m16 tile
        (9, 4096, torch.bfloat16, True, "1-8 rows"),  # the in-kernel quantization loads row g only
        (4, 4096, torch.float16, True, "bfloat16"),  # fp16 activations
    ],
)
def test_shape_checks_name_what_fits(m: int, k: int, dtype: torch.dtype, quant: bool, match: str) -> None:
    """A product the kernels cannot cover exactly is a ValueError that says what they take, before any launch."""
    x = torch.zeros(m, k, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        c._check_shapes(m, 4096, k, c.Fp8Config(4), quant, x)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the source")
def test_source_compiles_for_sm90_without_spills(tmp_path: Path) -> None:
    """nvcc compiles SOURCE for sm_90a (as NVRTC does on the GPU) with no register spills in any kernel."""
    (tmp_path / "k.cu").write_text(c.SOURCE)
    done = subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), "k.cu"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
    assert len(spills) == 2 * len(c.PS) and set(spills) == {"0"}, done.stderr


@needs_sm90
@pytest.mark.parametrize(("n", "k", "p"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_kernel_matches_the_blockwise_reference(n: int, k: int, p: int, m: int) -> None:
    """From quantize_activations' bytes and scales, the kernel equals the float32 product of the dequantized
    operands up to the bf16 rounding of its output (and float32 sums in another order)."""
    from fnvllm.kernels.fp8_gemm import fp8_blockwise_ref, quantize_activations

    w, w_scale = _weight(n, k)
    x_q, x_scale = quantize_activations(_x(m, k))
    out = c.fp8_skinny(x_q, w, w_scale, c.Fp8Config(p), x_scale=x_scale)
    ref = fp8_blockwise_ref(x_q, x_scale, w, w_scale, torch.float32)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n)
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-3 * float(ref.abs().max()))


@needs_sm90
@pytest.mark.parametrize(("n", "k", "p"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_in_kernel_quantization_is_the_quantization_launch(n: int, k: int, p: int, m: int) -> None:
    """Quantizing bf16 activations in the kernel gives the bits of quantize_activations followed by the kernel
    (the same e4m3 bytes and scales, the same sums), including an all-zero row and group."""
    from fnvllm.kernels.fp8_gemm import quantize_activations

    w, w_scale = _weight(n, k, seed=2)
    x = _x(m, k, seed=3)
    x[0, :128] = 0  # a zero group: scale 1e-12
    if m > 1:
        x[-1] = 0  # a zero row
    x_q, x_scale = quantize_activations(x)
    want = c.fp8_skinny(x_q, w, w_scale, c.Fp8Config(p), x_scale=x_scale)
    got = c.fp8_skinny(x, w, w_scale, c.Fp8Config(p, quant_rows=8))
    assert torch.equal(got, want)


@needs_sm90
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_linear_takes_it_for_listed_weights(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """fp8_linear on a listed weight launches this kernel (one launch fewer with in-kernel quantization at the
    rows its entry allows) and agrees with the Triton path it replaces (cuda_skinny off) within bf16 rounding;
    ready activations (fp8_linear_prepared) give the bits of the bf16 call."""
    from fnvllm.kernels import fp8_gemm
    from fnvllm.kernels.fused_ops import Fp8Activations

    n, k = 4096, 4096
    w, w_scale = _weight(n, k, seed=4)
    x = _x(m, k, seed=5)
    calls: list[bool] = []
    real = c.fp8_skinny
    monkeypatch.setattr(c, "fp8_skinny", lambda *a, **kw: calls.append(kw.get("x_scale") is None) or real(*a, **kw))
    monkeypatch.setitem(c.FP8_CONFIGS, (n, k), c.Fp8Config(4, quant_rows=4))
    got = fp8_gemm.fp8_linear(x, w, w_scale)
    assert calls == [m <= 4]
    prepared = fp8_gemm.fp8_linear(Fp8Activations(*fp8_gemm.quantize_activations(x), torch.bfloat16), w, w_scale)
    assert torch.equal(prepared, got)
    monkeypatch.setattr(cuda_skinny, "ENABLED", False)
    triton_path = fp8_gemm.fp8_linear(x, w, w_scale)
    scale = float(triton_path.float().abs().max())
    torch.testing.assert_close(got.float(), triton_path.float(), rtol=2**-7, atol=2e-3 * scale)


@needs_sm90
@pytest.mark.parametrize("quant_rows", [0, 8])
def test_graph_replays_give_the_eager_bits(quant_rows: int) -> None:
    """Captured in a CUDA graph (after an eager call compiled it), replays on new activations give the eager
    result's bits."""
    w, w_scale = _weight(4096, 4096, seed=6)
    cfg = c.Fp8Config(4, quant_rows=quant_rows)
    x = _x(8, 4096, seed=7)

    def run(x: torch.Tensor) -> torch.Tensor:
        from fnvllm.kernels.fp8_gemm import _cuda_fp8_linear

        return _cuda_fp8_linear(x, w, w_scale, cfg)

    run(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x)
    for seed in (8, 9):
        x.copy_(_x(8, 4096, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(x.clone()))
