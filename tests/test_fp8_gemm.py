"""The FP8 weight GEMM kernels (fnvllm.kernels.fp8_gemm) against their torch references: the streaming small-M
kernel and the swapped fp8 tensor-core kernel under Triton's CPU interpreter at tiny and odd shapes (M = 1, 3, 16,
17, 64, 100; N and K multiples of 128 and not), their launch-config choices and checks, and the shipped dispatch
on a GPU at the real Qwen3-8B sizes."""

from __future__ import annotations

import pytest
import torch

from fnvllm.kernels import fp8_gemm as g
from fnvllm.model.quant import quantize_fp8_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight (n, k) with block scales that differ by row (rows scaled by U(0, 1))."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    return tuple(t.to(DEVICE) for t in quantize_fp8_blocks(w))  # type: ignore[return-value]


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """Activations (m, k) in bf16."""
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)


# (M, N, K, config): one token with partial edge blocks and the default pick; the conversions and both operand
# orders; K steps wider than a scale block (one step spans several scales); split-K with a partial last split;
# 17 and 64 tokens (activation tiles of 32 and 64 rows).
STREAM_CASES = [
    (1, 200, 300, None),
    (3, 130, 260, g.SmallMConfig(32, 128, 2, convert="bits")),
    (16, 256, 640, g.SmallMConfig(128, 512, 2, convert="cast")),
    (5, 96, 384, g.SmallMConfig(16, 128, 3, swap=False, convert="asm")),
    (17, 64, 128, g.SmallMConfig(64, 256, 1, swap=False, convert="cast")),
    (64, 300, 520, g.SmallMConfig(64, 256, 2, convert="bits")),
    (2, 200, 1000, g.SmallMConfig(32, 128, 4, reduce="launch")),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), STREAM_CASES)
def test_stream_kernel_matches_reference(m: int, n: int, k: int, config: g.SmallMConfig | None) -> None:
    """fp8_gemm_small_m equals the dequantize-then-matmul reference on the same bf16 activations, up to bf16
    rounding of the scaled activations and of the output (relative Frobenius error < 1e-2, no element off by
    more than 3 % of the largest)."""
    w, scale = _weights(n, k)
    x = _x(m, k)
    out = g.fp8_gemm_small_m(x, w, scale, config)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n)
    ref = g.fp8_linear_ref(x.float(), w, scale)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    assert float((out.float() - ref).abs().max()) < 0.03 * float(ref.abs().max())


def test_stream_kernel_fp16_activations() -> None:
    """fp16 activations give an fp16 result equal to the reference (the kernel multiplies in bf16 inside)."""
    w, scale = _weights(128, 256, seed=7)
    x = _x(2, 256).half()
    out = g.fp8_gemm_small_m(x, w, scale)
    ref = g.fp8_linear_ref(x.float(), w, scale)
    assert out.dtype == torch.float16 and float((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_bit_moved_widening_is_exact_for_normal_values() -> None:
    """The kernels' e4m3 -> bf16 by bit moves, scaled back by 2**120, gives every normal e4m3 value exactly:
    a weight holding all 238 normal codes (both signs), scale 1, times identity activations reads back as itself.
    (Subnormal codes are exact on the GPU; the CPU interpreter's bf16 mishandles subnormals, so they stay out.)"""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    normal = codes[(codes.float().abs() >= 2**-6) & codes.float().isfinite()]
    assert normal.numel() == 238  # exponent fields 1..15 x 8 mantissas x 2 signs, less the 2 NaN codes
    w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    w[:15, :16] = torch.cat([normal, torch.zeros(2, dtype=torch.float8_e4m3fn)]).view(15, 16)
    w, scale = w.to(DEVICE), torch.ones(1, 2, device=DEVICE)
    eye = torch.eye(16, 256, device=DEVICE, dtype=torch.bfloat16)  # token i reads weight column i
    out = g.fp8_gemm_small_m(eye, w, scale, g.SmallMConfig(convert="bits")).float()
    torch.testing.assert_close(out, w.float()[:, :16].T, atol=0, rtol=0)


SWAP_CASES = [
    (1, 200, 300, None),
    (3, 130, 260, g.SwapConfig(32, 16, 2)),
    (17, 256, 384, None),
    (40, 256, 640, g.SwapConfig(128, 32, 3)),
    (100, 128, 256, g.SwapConfig(64, 64, 1)),
    (20, 200, 1000, g.SwapConfig(64, 16, 3, reduce="launch")),
    (33, 300, 256, g.SwapConfig(256, 32, 1)),
    # the kernel-side levers: weight tiles by TMA descriptor (zeros past N and K from the descriptor), with
    # split-K and both reduces; pdl/prefetch (no-ops off the GPU) must not change the result
    (1, 200, 304, g.SwapConfig(64, 16, 2, tma=True)),
    (17, 256, 640, g.SwapConfig(128, 32, 3, reduce="launch", tma=True)),
    (3, 300, 256, g.SwapConfig(256, 16, 1, tma=True, pdl=True, prefetch=True)),
    # weight blocks read before the PDL wait and added after the loop: splits of 1, 2, 3 and 7 blocks (the second
    # preloaded block past a one-block split is read, not added), ragged K, pointer loads and TMA
    (2, 200, 300, g.SwapConfig(64, 16, 3, preload=1)),
    (3, 130, 260, g.SwapConfig(32, 16, 3, preload=2)),
    (17, 256, 640, g.SwapConfig(128, 32, 2, reduce="launch", preload=2, tma=True)),
    (5, 300, 1000, g.SwapConfig(64, 16, 3, pdl=True, prefetch=True, preload=2, tma=True)),
    (1, 200, 896, g.SwapConfig(64, 16, 1, preload=1, tma=True)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), SWAP_CASES)
def test_swap_kernel_matches_reference(m: int, n: int, k: int, config: g.SwapConfig | None) -> None:
    """fp8_gemm_swap on quantized activations equals the float32 math of the same fp8 operands and scales
    (several token tiles, K splits, partial edge blocks; a misplaced or doubled tile is off by far more than the
    GPU's tolerance)."""
    w, scale = _weights(n, k, seed=3)
    x_q, x_scale = g.quantize_activations_ref(_x(m, k, seed=4))
    out = g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, config)
    _assert_matches_fp8_math(out, g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32))


def test_tile_major_weight_lays_each_tile_contiguous() -> None:
    """The docstring's worked example, on bytes that name their own (row, column): N = 4, K = 256, block_n = 2
    gives rows 0-1 of K block 0, rows 0-1 of K block 1, rows 2-3 of K block 0, rows 2-3 of K block 1; ragged N
    and K are padded with zero bytes; bad input names the field."""
    codes = (torch.arange(4)[:, None] * 2 + torch.arange(256)[None, :] // 128).to(torch.uint8)  # row * 2 + block
    laid = g.tile_major_weight(codes.view(g.FP8_DTYPE), 2)
    tiles = laid.tiles.view(torch.uint8)
    assert laid.block_n == 2
    assert tiles.shape == (8, 128)
    assert tiles[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # (row 0, block 0), (row 1, block 0), (row 0, block 1)...
    assert bool((tiles == tiles[:, :1]).all())
    ragged = g.tile_major_weight(torch.ones(3, 130, dtype=torch.uint8).view(g.FP8_DTYPE), 2).tiles.view(torch.uint8)
    assert ragged.shape == (2 * 2 * 2, 128) and int(ragged.sum()) == 3 * 130  # the pad is zeros
    with pytest.raises(ValueError, match="block_n"):
        g.tile_major_weight(codes.view(g.FP8_DTYPE), 0)
    with pytest.raises(ValueError, match="w must be"):
        g.tile_major_weight(codes, 2)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 200, 300, g.SwapConfig(64, 16, 2)),
        (17, 256, 640, g.SwapConfig(128, 32, 3, reduce="launch", tma=True)),
        (3, 130, 1000, g.SwapConfig(32, 16, 3, preload=2, tma=True)),
        (5, 300, 256, g.SwapConfig(64, 16, 1, pdl=True, prefetch=True, preload=1)),
    ],
)
def test_swap_kernel_reads_the_tile_major_layout_bit_for_bit(m: int, n: int, k: int, config: g.SwapConfig) -> None:
    """fp8_gemm_swap with w_tiles (the weight as tile_major_weight lays it out) returns exactly what it returns
    from the (N, K) rows: the same products summed in the same order (pointer loads and TMA, ragged N and K, K
    splits, preloaded blocks); a layout for another block_n is refused."""
    w, scale = _weights(n, k, seed=5)
    x_q, x_scale = g.quantize_activations_ref(_x(m, k, seed=6))
    rows = g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, config)
    tiles = g.tile_major_weight(w, config.block_n)
    assert torch.equal(rows, g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, config, w_tiles=tiles))
    with pytest.raises(ValueError, match="w_tiles"):
        g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, config, w_tiles=g.tile_major_weight(w, 16))


def _assert_matches_fp8_math(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out equals ref, the float32 math of the same fp8 operands: to float32 rounding under the interpreter, to a
    relative error below 1e-2 on a GPU (its fp8 tensor-core sums keep fewer bits)."""
    if DEVICE == "cuda":
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    else:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [(1, 200, 300, None), (17, 256, 640, g.SwapConfig(128, 32, 3)), (5, 130, 384, g.SwapConfig(64, 16, 2, tma=True))],
)
def test_swap_kernel_quantizing_in_its_prologue_matches_reference(
    m: int, n: int, k: int, config: g.SwapConfig | None
) -> None:
    """fp8_gemm_swap_bf16 (activations quantized inside the kernel) equals the float32 math of the reference's
    quantized activations up to the bf16 rounding of the result (relative error < 1e-2; with a float32 result the
    two agree bit for bit) and returns x's dtype."""
    w, scale = _weights(n, k, seed=9)
    x = _x(m, k, seed=10) * 3
    out = g.fp8_gemm_swap_bf16(x, w, scale, config)
    ref = g.fp8_blockwise_ref(*g.quantize_activations_ref(x), w, scale, torch.float32)
    assert out.dtype == torch.bfloat16 and float((out.float() - ref).norm() / ref.norm()) < 1e-2
    x_q, x_scale = g.quantize_activations(x)
    exact = g._launch_swap(x, None, w, scale, torch.float32, config)
    assert torch.equal(exact, g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, config))


BLOCKWISE_CASES = [
    (3, 130, 260, g.BlockwiseConfig(16, 16, 2, split_k=2)),
    (40, 256, 640, g.BlockwiseConfig(32, 64, 1, split_k=3)),
    (33, 300, 256, g.BlockwiseConfig(16, 256, 4)),
    (20, 200, 1000, g.BlockwiseConfig(16, 128, 8, split_k=3, reduce="launch")),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), BLOCKWISE_CASES)
def test_blockwise_configs_match_reference(m: int, n: int, k: int, config: g.BlockwiseConfig) -> None:
    """fp8_gemm_blockwise with narrow or wide weight tiles, several token tiles, K splits (summed by the last
    program or a second launch) and partial edge blocks equals the float32 math of the same fp8 operands."""
    w, scale = _weights(n, k, seed=5)
    x_q, x_scale = g.quantize_activations_ref(_x(m, k, seed=6))
    out = g.fp8_gemm_blockwise(x_q, x_scale, w, scale, torch.float32, config=config)
    ref = g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="block_m"):
        g.fp8_gemm_blockwise(x_q, x_scale, w, scale, torch.float32, config=g.BlockwiseConfig(block_m=8))


def test_tuned_blockwise_shapes_are_valid_and_bounded() -> None:
    """Every measured blockwise launch shape passes its check and is keyed at most BLOCKWISE_MAX_M tokens, so
    fp8_linear never routes a token count it was not measured for past cuBLAS; untuned shapes find none."""
    for (_, _, up_to), cfg in g.TUNED_BLOCKWISE.items():
        cfg.check()
        assert g.SWAP_MAX_M < up_to <= g.BLOCKWISE_MAX_M
    assert g._tuned(g.TUNED_BLOCKWISE, 40, 24576, 4096) == g.TUNED_BLOCKWISE[24576, 4096, 64]
    assert g._tuned(g.TUNED_BLOCKWISE, 65, 24576, 4096) is None
    assert g._tuned(g.TUNED_BLOCKWISE, 40, 6144, 4096) is None


def test_fused_swap_routing_is_per_measured_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_linear quantizes inside the swap kernel only for weight shapes in SWAP_FUSED_MAX_M and only up to their
    token bound; other shapes, larger M and M = 0 keep the two-launch path (the measured table is empty: the two
    launches won everywhere)."""
    for (n, k), up_to in g.SWAP_FUSED_MAX_M.items():
        assert 0 < up_to <= g.SWAP_MAX_M and n % 128 == 0 and k % 128 == 0
    assert not g.swaps_fused(1, 4096, 4096) or (4096, 4096) in g.SWAP_FUSED_MAX_M
    monkeypatch.setattr(g, "SWAP_FUSED_MAX_M", {(4096, 4096): 16})
    assert g.swaps_fused(1, 4096, 4096) and g.swaps_fused(16, 4096, 4096)
    assert not g.swaps_fused(17, 4096, 4096) and not g.swaps_fused(0, 4096, 4096)
    assert not g.swaps_fused(1, 24576, 4096) and not g.swaps_fused(1, 4096, 12288)


def test_split_counters_return_to_zero() -> None:
    """With reduce="last" the tile counters are back at zero after a launch (so the next launch, or CUDA-graph
    replay, starts clean), and a second call gives the same bits (the sum order is fixed)."""
    w, scale = _weights(256, 1024, seed=8)
    x = _x(3, 1024)
    first = g.fp8_gemm_small_m(x, w, scale, g.SmallMConfig(32, 128, 4))
    assert int(g._locks[x.device].abs().sum()) == 0
    assert torch.equal(first, g.fp8_gemm_small_m(x, w, scale, g.SmallMConfig(32, 128, 4)))
    x_q, x_scale = g.quantize_activations_ref(x)
    g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, g.SwapConfig(64, 16, 4))
    assert int(g._locks[x.device].abs().sum()) == 0


def _programs(tiles: int, k_steps: int, split: int) -> int:
    """Programs a launch runs: tiles x the splits left once each split gets ceil(k_steps / split) steps."""
    per_split = -(-k_steps // split)
    return tiles * -(-k_steps // per_split)


def test_picks_fill_the_sms() -> None:
    """The default launch shapes give >= 1.5 programs per SM (132) on the Qwen3-8B GEMMs, with at least two K
    steps per split, and no split where K has one step."""
    cpu = torch.device("cpu")
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        cfg = g.pick_small_m_config(1, n, k, cpu)
        assert _programs(-(-n // cfg.block_n), k // cfg.block_k, cfg.split_k) >= 198
        assert k // cfg.block_k >= 2 * cfg.split_k
        for m in (32, 64, 256):
            sw = g.pick_swap_config(m, n, k, cpu)
            assert _programs(-(-n // sw.block_n) * -(-m // sw.block_t), k // 128, sw.split_k) >= 198
    assert g.pick_small_m_config(1, 64, 128, cpu).split_k == 1


def test_tuned_swap_shapes_are_valid_and_bounded() -> None:
    """Every measured swap launch shape passes its check, is keyed at most SWAP_MAX_M tokens and has tokens per
    tile covering its key up to 16 (one token tile), so the sweep's table cannot hand fp8_linear a broken launch."""
    for (n, k, up_to), cfg in g.TUNED_SWAP.items():
        cfg.check()
        assert 0 < up_to <= g.SWAP_MAX_M and n > 0 and k > 0
        assert cfg.block_t >= min(up_to, 16)
        assert not (cfg.tma or cfg.prefetch) or k % 16 == 0


def test_swap_lever_checks() -> None:
    """An L2 prefetch without PDL (it runs before the PDL wait) is refused; TMA and prefetch on weights whose rows
    are not 16-byte multiples fall back to pointer loads with the same result."""
    with pytest.raises(ValueError, match="prefetch needs pdl"):
        g.SwapConfig(prefetch=True).check()
    with pytest.raises(ValueError, match="preload must be 0, 1 or 2"):
        g.SwapConfig(preload=3).check()
    w, scale = _weights(64, 200)
    x_q, x_scale = g.quantize_activations_ref(_x(2, 200))
    cfg = g.SwapConfig(64, 16, 1, tma=True, pdl=True, prefetch=True)
    out = g.fp8_gemm_swap(x_q, x_scale, w, scale, torch.float32, cfg)
    _assert_matches_fp8_math(out, g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32))


def test_small_m_swap_pick_follows_the_swept_pattern() -> None:
    """Up to SWAP_MAX_M tokens an untuned weight gets the swept pattern (64 x 16 tiles, PDL, TMA, second-launch
    split sum) with ~4 programs per SM or one split when its tiles already give 2 per SM; above, the old rule."""
    cpu = torch.device("cpu")
    small = g.pick_swap_config(8, 2048, 1024, cpu)  # a Qwen3-0.6B-sized weight: 32 tiles, 8 K blocks
    assert (small.block_n, small.block_t, small.pdl, small.tma, small.reduce) == (64, 16, True, True, "launch")
    assert small.split_k == 2  # at most one split per four K blocks
    assert g.pick_swap_config(1, 24576, 4096, cpu).split_k == 1  # 384 tiles >= 2 per SM
    assert g.pick_swap_config(1, 4096, 12288, cpu).split_k == 9  # 64 tiles -> ~4 programs per SM
    assert not g.pick_swap_config(64, 4096, 4096, cpu).tma


def test_bad_configs_and_operands_are_refused() -> None:
    """A config knob out of range, too many tokens, a 16-bit weight or a wrongly shaped scale is a ValueError
    naming what is wrong."""
    w, scale = _weights(64, 128)
    x = _x(2, 128)
    with pytest.raises(ValueError, match="block_n"):
        g.fp8_gemm_small_m(x, w, scale, g.SmallMConfig(block_n=48))
    with pytest.raises(ValueError, match="convert"):
        g.fp8_gemm_small_m(x, w, scale, g.SmallMConfig(convert="fast"))
    with pytest.raises(ValueError, match="M <= 64"):
        g.fp8_gemm_small_m(_x(65, 128), w, scale)
    with pytest.raises(ValueError, match="block_t"):
        g.fp8_gemm_swap(*g.quantize_activations_ref(x), w, scale, torch.float32, g.SwapConfig(block_t=8))
    with pytest.raises(ValueError, match="w must be contiguous"):
        g.fp8_gemm_small_m(x, w.float(), scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        g.fp8_gemm_small_m(x, w, scale[:, :0])


# ---- on a GPU ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 17, 64, 100, 256, 300])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_fp8_linear_on_cuda_matches_references(m: int, n: int, k: int) -> None:
    """fp8_linear at Qwen3-8B sizes on every side of its thresholds equals its reference: the dequantize-then-
    matmul product of the bf16 activations up to STREAM_MAX_M tokens, the product of the same quantized operands
    above (relative error < 1e-2)."""
    w, scale = _weights(n, k, seed=5)
    x = torch.randn(m, k, device="cuda").bfloat16()
    out = g.fp8_linear(x, w, scale)
    if m <= g.STREAM_MAX_M:
        ref = g.fp8_linear_ref(x.float(), w, scale)
    else:
        ref = g.fp8_blockwise_ref(*g.quantize_activations(x), w, scale, torch.float32)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("convert", g.CONVERTS)
@pytest.mark.parametrize("swap", [True, False])
def test_stream_conversions_on_cuda_agree(convert: str, swap: bool) -> None:
    """On the GPU every e4m3 -> bf16 conversion (inline PTX, Triton bit ops, Triton's cast) and both operand
    orders give the reference product (the PTX one runs only here)."""
    w, scale = _weights(4096, 4096, seed=6)
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    out = g.fp8_gemm_small_m(x, w, scale, g.SmallMConfig(split_k=2, swap=swap, convert=convert))
    ref = g.fp8_linear_ref(x.float(), w, scale)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "config",
    [
        g.SwapConfig(128, 16, 4, pdl=True),
        g.SwapConfig(128, 16, 4, pdl=True, prefetch=True),
        g.SwapConfig(128, 16, 4, tma=True),
        g.SwapConfig(256, 16, 2, num_warps=8, tma=True, pdl=True, prefetch=True, reduce="launch"),
        g.SwapConfig(64, 16, 4, num_stages=4, tma=True, pdl=True, reduce="launch", preload=1),
        g.SwapConfig(64, 16, 8, num_stages=3, tma=True, pdl=True, reduce="launch", preload=2),
        g.SwapConfig(64, 16, 32, num_stages=3, pdl=True, preload=2),
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_swap_levers_on_cuda_match_reference(config: g.SwapConfig, fused: bool) -> None:
    """On the GPU the swap kernel's levers (PDL wait, L2 prefetch before it, TMA weight tiles), quantizing in its
    prologue or not, give the product of the same quantized operands (relative error < 1e-2)."""
    w, scale = _weights(6144, 4096, seed=7)
    x = torch.randn(5, 4096, device="cuda").bfloat16()
    x_q, x_scale = g.quantize_activations(x)
    out = (
        g.fp8_gemm_swap_bf16(x, w, scale, config) if fused else g.fp8_gemm_swap(x_q, x_scale, w, scale, x.dtype, config)
    )
    ref = g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
