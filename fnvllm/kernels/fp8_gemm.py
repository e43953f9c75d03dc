"""FP8 weight GEMMs in Triton, beside the torch reference (``fp8_linear_ref``).

The weight format is the official block-quantized one (DeepSeek-V3, Qwen3-*-FP8): ``w`` (N, K) float8_e4m3fn and
``w_scale`` (ceil(N / 128), ceil(K / 128)) float32, one scale per 128 x 128 block, so that the real weight is
``w[n, k] * w_scale[n // 128, k // 128]`` (HF calls the scale ``weight_scale_inv``; it multiplies). Edge blocks
(N or K not a multiple of 128) are partial; their scale covers the rows and columns that exist.

Kernels, picked by the number of tokens M (``fp8_linear``):

- ``fp8_gemm_small_m`` (M <= STREAM_MAX_M, decode): bandwidth-bound, so it only has to stream the weight bytes.
  Activations stay 16-bit. Each program walks a (BLOCK_N rows, K range) tile in BLOCK_K steps: the fp8 tile is
  widened to bf16 by moving bits (sign, exponent|mantissa >> 4: the value times 2**-120, no cvt instructions,
  whose throughput caps Triton's own e4m3 -> bf16 at ~2.8 TB/s on an H200), the block scales (times 2**60) ride
  on the activation columns, and the accumulator takes the remaining 2**60 at the end. Split-K (float32
  partials, summed in order by a second kernel) keeps every SM streaming when N is small.
- ``fp8_gemm_swap`` (STREAM_MAX_M < M <= SWAP_MAX_M): activations quantized per (token, 128 columns)
  (``quantize_activations``), then fp8 x fp8 on the tensor cores with the weight rows on the dot's wide side
  and the tokens on its narrow side (so 16-256 tokens fill a wgmma), split-K as above. The activations may also
  come quantized by the kernel that wrote them (``fused_ops.Fp8Activations``: the RMSNorm or SiLU-and-mul before
  the GEMM, ``Fp8Producers``; FNVLLM_FP8_FUSED_QUANT=0 turns it off), which saves the quantization launch.
- ``fp8_gemm_blockwise`` (prefill, where cuBLAS lacks the recipe): both operands fp8, (BLOCK_M tokens, 128 rows)
  tiles, x_scale[m, kg] * w_scale[n_block, kg] applied to each 128-deep partial product (DeepSeek-V3's scheme).
- ``fp8_scaled_mm`` (above SWAP_MAX_M, where torch and the GPU have it): the same activation quantization, then
  cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales,
  sm_90, CUDA >= 12.9).
- ``fp8_rowwise_mm`` (above ``rowwise_min_m`` tokens, for weights quantized at load in 128-row groups, which carry
  a (1, N) row scale: ``fnvllm.model.quant``): activations quantized per token (``quantize_per_token``, one float32
  scale per row), then torch's row-wise ``_scaled_mm`` (scale_a (M, 1), scale_b (1, N); on sm_90 a CUTLASS kernel
  that applies both scales in its epilogue, so the main loop is plain fp8 x fp8 like the per-tensor recipe). Off
  with ``FNVLLM_FP8_ROWWISE=0`` (read at import).

Programmatic dependent launch (``fused_ops.use_pdl``, on by default on sm_90): the activation quantization and
``fp8_gemm_blockwise`` launch early and wait on the kernel before them; before that wait, the blockwise kernel
asks L2 for the first blocks of its weight rows (``cp.async.bulk.prefetch.L2``), which no earlier kernel
writes, so weight bytes stream in during the previous kernel's tail. On the H200 (bench_fp8_gemm.py at 7d1055e
against 6eb87a6, bf16 times equal in both runs) cuBLAS's fp8 path (quantization launch + GEMM) measured 2-14 us
faster per GEMM at 64-256 tokens, the quantization's early start being the only change on that path. The swap
kernel takes PDL, the prefetch and TMA weight tiles as ``SwapConfig`` knobs; swept per weight and M (TUNED_SWAP),
PDL and TMA won almost everywhere, the prefetch nowhere (it had made the o GEMM 1-1.4 us slower before). The
``preload`` knob (weight blocks read into registers before the wait) measured no faster per layer on an H100
(BENCHMARKS.md, thirty-fourth session), so no table entry takes it.

Under the Triton CPU interpreter fp8 pointers load and widen correctly (triton 3.9), so the kernels take the
float8 tensors themselves; 16-bit dot operands are widened to float32 there (``decode_attention.dot``). The
interpreter's float32 -> e4m3 conversion is wrong where rounding crosses a power of two (126.25 -> 64), so under
it ``quantize_activations`` rounds to the e4m3 grid in float32 first (half away from zero; the GPU rounds half to
even: ties differ, nothing else).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import attrs
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fnvllm.env import env_switch
from fnvllm.kernels import cuda_fp8_skinny
from fnvllm.kernels.decode_attention import dot, upcast_dot
from fnvllm.kernels.fused_ops import (
    Fp8Activations,
    SplitPartials,
    _sum_splits_kernel,
    fused_add_rmsnorm_quant,
    pdl_launch,
    quantize_groups,
    rmsnorm_quant,
    silu_and_mul_quant,
    sum_split_partials,
    use_pdl,
    wait_for_previous_kernel,
)
from fnvllm.kernels.fused_ops import round_to_e4m3 as _round_to_e4m3
from fnvllm.kernels.reference import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    SCALE_BLOCK,
    dequantize_fp8_blocks,
    expand_block_scales,
    fp8_linear_ref,
)

try:  # host-side TMA descriptors (Triton >= 3.4): SwapConfig.tma
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

# The references live in fnvllm.kernels.reference (torch only: the model imports them without Triton); they are
# re-exported here beside the kernels tested against them.
__all__ = [
    "FP8_DTYPE",
    "SCALE_BLOCK",
    "SMALL_M",
    "BlockwiseConfig",
    "Fp8Activations",
    "Fp8Producers",
    "SplitPartials",
    "TileMajorWeight",
    "dequantize_fp8_blocks",
    "expand_block_scales",
    "fp8_blockwise_ref",
    "fp8_gemm_blockwise",
    "fp8_gemm_small_m",
    "fp8_gemm_swap",
    "fp8_gemm_swap_bf16",
    "fp8_gemm_swap_partials",
    "fp8_linear",
    "fp8_linear_partials",
    "fp8_linear_prepared",
    "fp8_linear_ref",
    "fp8_producers",
    "fp8_rowwise_mm",
    "fp8_rowwise_ref",
    "fp8_scaled_mm",
    "fused_quant_from_env",
    "pick_ready_swap_config",
    "quantize_activations",
    "quantize_activations_ref",
    "quantize_per_token",
    "quantize_per_token_ref",
    "sum_partials",
    "takes_fp8_activations",
    "tile_major_weight",
]

SMALL_M = 64  # the most tokens fp8_gemm_small_m takes (its activation tile is M padded to a power of two)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_Config = TypeVar("_Config")  # SmallMConfig, SwapConfig or BlockwiseConfig


# ---- torch reference (the weight's in fnvllm.kernels.reference) ----------------------------------------------


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (M, K) fp8, x_scale (M, ceil(K / 128)) float32): each (token, 128-column group) scaled to amax 448."""
    m, k = x.shape
    groups = triton.cdiv(k, SCALE_BLOCK)
    padded = F.pad(x.float(), (0, groups * SCALE_BLOCK - k)).view(m, groups, SCALE_BLOCK)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # (M, groups)
    x_q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(m, groups * SCALE_BLOCK)[:, :k].contiguous(), scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (M, K) fp8, x_scale (M, 1) float32): each token (row) scaled to amax 448, scale >= MIN_SCALE."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # (M, 1)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_rowwise_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What ``fp8_rowwise_mm`` computes from per-token quantized activations (x_q (M, K), x_scale (M, 1)) and a
    row-group weight (w (N, K), row_scale (1, N)): in float32, cast to dtype."""
    return ((x_q.float() * x_scale) @ (w.float() * row_scale.reshape(-1, 1)).T).to(dtype)


def fp8_blockwise_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What ``fp8_gemm_blockwise`` computes from already quantized activations, in float32, cast to dtype."""
    k = x_q.shape[1]
    x = x_q.float() * x_scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, :k]
    return (x @ dequantize_fp8_blocks(w, w_scale, torch.float32).T).to(dtype)


# ---- dispatch ---------------------------------------------------------------------------------------------------


def fp8_linear(
    x: torch.Tensor | Fp8Activations,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) @ dequantized(w).T (+ bias) in x's dtype. On CUDA with 16-bit activations, by tokens M: when the weight
    has a ``row_scale`` (row groups, (1, N) float32) and ``takes_rowwise`` says so (M > ``rowwise_min_m``, bf16, the GPU
    has the recipe), ``fp8_rowwise_mm``; else up to STREAM_MAX_M ``fp8_gemm_small_m`` (streams the weight, activations
    stay 16-bit); up to SWAP_MAX_M the activations quantized and ``fp8_gemm_swap`` (fp8 tensor cores, weight rows on the
    wide side, split-K; its variant ``fp8_gemm_swap_bf16``, which quantizes in the kernel, one launch fewer, for the
    weights in SWAP_FUSED_MAX_M); up to BLOCKWISE_MAX_M ``fp8_gemm_blockwise`` for weights with a measured
    TUNED_BLOCKWISE shape; above, cuBLAS's block-scaled GEMM (``fp8_scaled_mm``) where torch has it and the weight is
    whole 128 x 128 blocks, else ``fp8_gemm_blockwise``. Elsewhere the torch reference. The thresholds come from
    benchmarks/bench_fp8_gemm.py on the H200 (BENCHMARKS.md, "FP8 weight GEMMs").

    x may also be activations quantized by the kernel that made them (``Fp8Activations``, see
    ``takes_fp8_activations``): then no quantization runs (``fp8_linear_prepared``).

    Ahead of all these, at 1-16 bf16 tokens of a weight ``cuda_fp8_skinny.FP8_CONFIGS`` lists (measured faster
    there), the CUDA few-row kernel ``cuda_fp8_skinny.fp8_skinny`` (bf16 out, no K split)."""
    if isinstance(x, Fp8Activations):
        return fp8_linear_prepared(x, w, w_scale, bias)
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return fp8_linear_ref(x, w, w_scale, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    _split_locks(x.device)  # made on the first (eager) call, so the decode graphs captured later can use them
    if row_scale is not None and takes_rowwise(m, x, w):
        return fp8_rowwise_mm(x, w, row_scale, bias)
    if (cuda := cuda_fp8_skinny.fp8_config(x, w, w_scale)) is not None:
        out = _cuda_fp8_linear(x, w, w_scale, cuda)
    elif m <= STREAM_MAX_M:
        out = fp8_gemm_small_m(x, w, w_scale)
    elif swaps_fused(m, *w.shape):
        out = fp8_gemm_swap_bf16(x, w, w_scale)
    elif m <= SWAP_MAX_M:
        out = fp8_gemm_swap(*quantize_activations(x), w, w_scale, x.dtype)
    elif m <= BLOCKWISE_MAX_M and _tuned(TUNED_BLOCKWISE, m, *w.shape) is not None:
        out = fp8_gemm_blockwise(*quantize_activations(x), w, w_scale, x.dtype)
    elif _has_block_scaled_mm(x.device.index or 0) and scaled_mm_supported(*w.shape):
        return fp8_scaled_mm(x, w, w_scale, bias)
    else:
        out = fp8_gemm_blockwise(*quantize_activations(x), w, w_scale, x.dtype)
    return out if bias is None else out.add_(bias)


def _cuda_fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: cuda_fp8_skinny.Fp8Config
) -> torch.Tensor:
    """bf16 x (M <= 16, K) @ dequantized(w).T by the CUDA few-row kernel: quantized in the kernel where its config
    takes M rows that way, else after ``quantize_activations`` (the same bytes and scales either way)."""
    if cuda_fp8_skinny.takes_quantization(config, x.shape[0]):
        return cuda_fp8_skinny.fp8_skinny(x, w, w_scale, config)
    x_q, x_scale = quantize_activations(x)
    return cuda_fp8_skinny.fp8_skinny(x_q, w, w_scale, config, x_scale=x_scale)


def fp8_linear_prepared(
    x: Fp8Activations, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantized activations x @ dequantized(w).T (+ bias) in x.dtype: ``cuda_fp8_skinny.fp8_skinny`` for bf16 at
    1-16 tokens of a weight its table lists, else ``fp8_gemm_swap`` up to SWAP_MAX_M tokens, ``fp8_gemm_blockwise``
    above. The GEMM ``fp8_linear`` runs after its own ``quantize_activations`` at those M,
    so the results are equal. Off CUDA the same kernels run under Triton's interpreter (only tests make
    ``Fp8Activations`` there: the CPU's FP8 path keeps 16-bit activations)."""
    x_q, x_scale, dtype = x
    m = x_q.shape[0]
    if dtype == torch.bfloat16 and (cuda := cuda_fp8_skinny.fp8_config(x_q, w, w_scale)) is not None:
        out = cuda_fp8_skinny.fp8_skinny(x_q, w, w_scale, cuda, x_scale=x_scale)
    elif m <= SWAP_MAX_M:
        _split_locks(x_q.device)  # made on the first (eager) call, as in fp8_linear
        out = fp8_gemm_swap(x_q, x_scale, w, w_scale, dtype, pick_ready_swap_config(m, *w.shape, x_q.device))
    else:
        out = fp8_gemm_blockwise(x_q, x_scale, w, w_scale, dtype)
    return out if bias is None else out.add_(bias)


# fp8_linear's kernel choice by tokens M (see its docstring). H200, one Qwen3-8B layer's four GEMMs, us per layer
# (benchmarks/bench_fp8_gemm.py, commit 6eb87a6): the swapped kernel (activation quantization + fp8_gemm_swap)
# 72.6 / 79.3 / 84.5 / 132.9 at M = 1 / 4 / 16 / 64, cuBLAS's block-scaled GEMM 118.5 / 103.5 / 102.9 / 125.5
# (and 133.8 / 162.7 at 128 / 256), the bf16-streaming kernel 131.4 / 142.0 / 131.1 / 305.5 (its sweep's best at
# M = 1: 98.3). So the streaming kernel is off (0), the swapped one takes up to 32 tokens (the crossover with
# cuBLAS lies between 16 and 64; interpolated near 48) and cuBLAS the rest.
STREAM_MAX_M = 0
SWAP_MAX_M = 32
# Up to this many tokens (above SWAP_MAX_M), weights with a TUNED_BLOCKWISE entry use ``fp8_gemm_blockwise``
# instead of cuBLAS: where its tuned launch shape measured faster (H200, bench_fp8_gemm.py --sweep, branch h-fp8 at
# 7d1055e, M = 64, us, blockwise tuned vs cuBLAS fp8 with its quantization launch: o 15.1 vs 17.8, gate_up 34.9 vs
# 38.1, down 27.2 vs 40.2; qkv 17.9 vs 18.2 is left to cuBLAS). At M = 128 and 256 cuBLAS was ahead on all four.
# With 64-token tiles, 33-64 tokens run the same programs as 64.
BLOCKWISE_MAX_M = 64
# Weights (N, K) whose products of at most this many tokens run ``fp8_gemm_swap_bf16`` (the activation quantization
# inside the swap kernel: one launch fewer) instead of quantization + ``fp8_gemm_swap``, where that measured faster
# (H200, bench_fp8_gemm.py at 7d1055e, us, fused vs two launches: o (4096 x 4096) 10.8 vs 11.5 at M = 1, 11.0 vs
# 12.8 at 4, 11.6 vs 14.2 at 16, 15.8 vs 15.6 at 32; gate_up and down were slower fused at every M). With each
# kernel's swept launch shape (h-f8s at df7e7f5, TUNED_SWAP) the two launches won for every weight at M = 1, 4, 16,
# 32 (o: 8.4 vs 9.3 us at 1, 9.3 vs 9.5 at 16), so none is fused.
SWAP_FUSED_MAX_M: dict[tuple[int, int], int] = {}


def swaps_fused(m: int, n: int, k: int) -> bool:
    """Whether ``fp8_linear`` takes ``fp8_gemm_swap_bf16`` for M tokens of an (N, K) weight (SWAP_FUSED_MAX_M)."""
    return 0 < m <= min(SWAP_MAX_M, SWAP_FUSED_MAX_M.get((n, k), 0))


# Activations quantized by the kernel that writes them (the RMSNorm before qkv and gate_up, the SiLU-and-mul before
# down: ``Fp8Producers``), so a small-M GEMM starts from ready fp8 inputs without a quantization launch. On by
# default: measured faster end to end on the H200 (2026-12-02, Qwen3-8B shape, FP8 weights + KV, ``fnvllm bench
# --latency 1,16``: 3.037 / 3.427 ms per decode step against 3.150 / 3.539 with it off; one layer's chain at M = 1 /
# 16: 63.5 / 69.0 us against 65.6 / 71.0). FNVLLM_FP8_FUSED_QUANT=0 (read when the model's ops are made,
# ``fnvllm.model.ops.triton_ops``) turns it off, anything but 0 or 1 is a ValueError naming the variable.
FUSED_QUANT_ENV = "FNVLLM_FP8_FUSED_QUANT"


def fused_quant_from_env() -> bool:
    """FUSED_QUANT_ENV's value as a switch ("1" or unset: on, "0": off); ValueError naming it otherwise."""
    return env_switch(FUSED_QUANT_ENV, True)


def takes_fp8_activations(m: int, n: int, k: int, has_row_scale: bool, dtype: torch.dtype) -> bool:
    """Whether M tokens of ``dtype`` activations for an (N, K) FP8 weight should come quantized by their producer
    (``Fp8Activations``): exactly where ``fp8_linear`` would run ``quantize_activations`` + ``fp8_gemm_swap`` on
    them (16-bit, STREAM_MAX_M < M <= SWAP_MAX_M, not the in-kernel quantization of SWAP_FUSED_MAX_M, not the
    row-wise GEMM, which takes per-token scales, for a weight with a row scale above ``rowwise_min_m``)."""
    if dtype not in _KERNEL_DTYPES or not STREAM_MAX_M < m <= SWAP_MAX_M or swaps_fused(m, n, k):
        return False
    return not (has_row_scale and ROWWISE and dtype == torch.bfloat16 and m > rowwise_min_m(n, k))


@attrs.frozen
class Fp8Producers:
    """The kernels that write a decoder layer's FP8 GEMM inputs already quantized (``Fp8Activations``), for the
    model (``ModelOps.fp8_producers``): rmsnorm (x, weight, eps) -> acts; add_rmsnorm (x, residual, weight, eps)
    -> (acts, new residual), x may be ``SplitPartials``; silu_and_mul (gate_up) -> acts. ``applies`` says when the
    model uses them.
    sum_down_splits: the down projection (from the SiLU's acts) leaves its K splits unsummed (``gemm_partials``,
    ``SplitPartials``) for the next layer's add_rmsnorm to sum, one launch fewer (single process, no bias, not the
    last layer: the model checks); ``sum_partials`` sums them where that norm does not apply.
    device_types: where they apply ("cuda"; the CPU's FP8 path is the torch reference, which keeps 16-bit
    activations: tests add "cpu" to run the kernels there under Triton's interpreter)."""

    rmsnorm: Callable[[torch.Tensor, torch.Tensor, float], Fp8Activations] = rmsnorm_quant
    add_rmsnorm: Callable[..., tuple[Fp8Activations, torch.Tensor]] = fused_add_rmsnorm_quant
    silu_and_mul: Callable[[torch.Tensor], Fp8Activations] = silu_and_mul_quant
    sum_down_splits: bool = False
    gemm_partials: Callable[[Fp8Activations, torch.Tensor, torch.Tensor], SplitPartials] = attrs.field(
        factory=lambda: fp8_linear_partials
    )
    sum_partials: Callable[[SplitPartials], torch.Tensor] = attrs.field(factory=lambda: sum_partials)
    device_types: tuple[str, ...] = ("cuda",)

    def applies(self, x: torch.Tensor | SplitPartials, linear: torch.nn.Module) -> bool:
        """Whether the input x (T, K) of ``linear`` (a projection whose FP8 weights carry ``weight_scale_inv``),
        or the value made from x (its sum, for split partials), should be made quantized: an FP8 weight, x on one
        of ``device_types``, and ``takes_fp8_activations`` for T tokens."""
        rows = x.parts[0] if isinstance(x, SplitPartials) else x  # (T, K)
        w, w_scale = linear.weight, getattr(linear, "weight_scale_inv", None)
        if w_scale is None or rows.device.type not in self.device_types:
            return False
        row_scale = getattr(linear, "weight_row_scale", None)
        return takes_fp8_activations(rows.shape[0], *w.shape, row_scale is not None, x.dtype)


# The down projection's split sum in the next layer's add + RMSNorm (``Fp8Producers.sum_down_splits``): off by
# default until measured; FNVLLM_FP8_NORM_SUMS_SPLITS=1 turns it on (with FNVLLM_FP8_FUSED_QUANT=1 only).
NORM_SUMS_SPLITS_ENV = "FNVLLM_FP8_NORM_SUMS_SPLITS"


def fp8_producers(sum_down_splits: bool | None = None) -> Fp8Producers:
    """The Triton producers of ``Fp8Activations`` (``fused_ops``' ``*_quant`` kernels); sum_down_splits None
    reads NORM_SUMS_SPLITS_ENV ("0" or unset: off, "1": on; otherwise a ValueError naming it)."""
    if sum_down_splits is None:
        sum_down_splits = env_switch(NORM_SUMS_SPLITS_ENV, False)
    return Fp8Producers(sum_down_splits=sum_down_splits)


@functools.cache
def _has_block_scaled_mm(device_index: int) -> bool:
    """Whether torch._scaled_mm takes DeepSeek-style block scales on this GPU (sm_90 with CUDA >= 12.9): one small
    product is tried once per device. (torch tells the recipes apart by the scales' shapes: with one 128-column
    group a (M, 1) activation scale would read as row-wise, hence K = 512 here.)"""
    w = torch.zeros(384, 512, dtype=FP8_DTYPE, device=f"cuda:{device_index}")
    x = torch.zeros(8, 512, dtype=torch.bfloat16, device=w.device)
    return _runs(lambda: fp8_scaled_mm(x, w, torch.ones(3, 4, device=w.device)))


def _runs(product: Callable[[], object]) -> bool:
    """Whether ``product`` (one small probe product) runs on this GPU and torch: False where it raises."""
    try:
        product()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


# ---- small M: stream the weight bytes ---------------------------------------------------------------------------

# The e4m3 -> bf16 widening by bit moves (``_e4m3_bits``) yields w * 2**-120; the activations carry 2**60 of the
# 2**120 back and the accumulator the other 2**60, so neither leaves float32/bf16's normal range (|x * s| from
# ~1e-20 to ~1e20 stays exact to bf16 rounding).
_HALF_BIAS = tl.constexpr(2.0**60)

# e4m3 bytes b0..b3 in one 32-bit register -> bf16 pairs (b0, b1), (b2, b3): each byte moved to the high half of a
# 16-bit lane (prmt), then sign kept and exponent|mantissa shifted right by 4 into bf16's places. Four integer
# instructions per pair, none on the conversion pipe (Triton's own e4m3 -> bf16 takes three cvt per pair, and the
# cvt pipe's 16 results per clock per SM cap a stream at ~2.8 TB/s on an H200).
_E4M3_TO_BF16_ASM = tl.constexpr("""{
.reg .b32 a0, a1, s0, s1, t0, t1;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 s0, a0, 0x80008000;
and.b32 s1, a1, 0x80008000;
shr.b32 t0, a0, 4;
shr.b32 t1, a1, 4;
and.b32 t0, t0, 0x07F007F0;
and.b32 t1, t1, 0x07F007F0;
or.b32 $0, s0, t0;
or.b32 $1, s1, t1;
}""")

CONVERTS = ("asm", "asm_hoisted", "bits", "cast")  # SmallMConfig.convert's choices (see _e4m3_bits)


@triton.jit
def _e4m3_bits(w, ASM: tl.constexpr, ASM_HOISTED: tl.constexpr):
    """e4m3 w -> bf16 holding w * 2**-120 exactly (the same bits moved: sign, then exponent|mantissa >> 4 into a
    16-bit lane; e4m3's exponent bias 7 read with bf16's 127). ASM: one inline-PTX block per 4 values (GPU only).

    ASM_HOISTED marks the block pure, so Triton converts in the dot operand's register layout (no shared-memory
    round trip for the bf16 tile, but that layout holds 2 consecutive bytes per load: ~2.4 extra byte-packing
    instructions per weight on sm_90); otherwise it converts in the load's layout (16-byte vectors) and stages
    the bf16 tile through shared memory (4.5 instructions per weight in all, against 6.7; measured in the SASS of
    a 64 x 256 tile)."""
    u = w.to(tl.uint8, bitcast=True)
    if ASM:
        return tl.inline_asm_elementwise(
            _E4M3_TO_BF16_ASM, "=r,=r,r", [u], dtype=tl.bfloat16, is_pure=ASM_HOISTED, pack=4
        )
    v = u.to(tl.uint16)
    return (((v & 0x80) << 8) | ((v & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _stream_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_sn, K_PER_SPLIT, NUM_SPLITS,
    SPLIT_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    BITS: tl.constexpr, ASM: tl.constexpr, ASM_HOISTED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_N rows, K range) tile: out[split, :, rows] = sum over its BLOCK_K steps of
    (x * w_scale[row block, k // 128]) @ widen(w).T. The block scale rides on the (few) activation columns, not
    on the accumulator, so a step may span several 128-wide scale blocks; SWAP puts the weight tile on the dot's
    left (BLOCK_N >= 64 rows: Hopper's wgmma) and the tokens on its right."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    scale_row = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + offs_k
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :],
                    mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0.0)  # fmt: skip
        s = tl.load(scale_row + k // 128, mask=k < K, other=0.0)  # (BLOCK_K,) float32
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
        if BITS:
            xs = (x.to(tl.float32) * (s * _HALF_BIAS)[None, :]).to(tl.bfloat16)
            wb = _e4m3_bits(w, ASM, ASM_HOISTED)
        else:
            xs = (x.to(tl.float32) * s[None, :]).to(tl.bfloat16)
            wb = w.to(tl.bfloat16)
        if SWAP:
            acc += dot(wb, tl.trans(xs), "tf32", UPCAST)  # (BLOCK_N, BLOCK_M)
        else:
            acc += dot(xs, tl.trans(wb), "tf32", UPCAST)  # (BLOCK_M, BLOCK_N)
    if BITS:
        acc = acc * _HALF_BIAS
    if SWAP:
        offs, mask = offs_m[None, :] * N + offs_n[:, None], (offs_n[:, None] < N) & (offs_m[None, :] < M)
    else:
        offs, mask = offs_m[:, None] * N + offs_n[None, :], (offs_m[:, None] < M) & (offs_n[None, :] < N)
    _write_tile(acc, offs, mask, out_ptr, part_ptr, lock_ptr, split, NUM_SPLITS, pid_n, M * N, SPLIT_MODE)


# How the K splits of a tile are summed (``_write_tile``'s SPLIT_MODE): one split writes its result; "launch":
# each split writes a float32 partial, a second kernel sums them; "last": the partials are summed by whichever
# program of the tile arrives last (an atomic counter per tile, reset by that program), saving the launch.
_ONE_SPLIT, _SUM_LAUNCH, _SUM_LAST = 0, 1, 2
SPLIT_REDUCES = ("last", "launch")  # the configs' ``reduce`` choices


@triton.jit
def _write_tile(acc, offs, mask, out_ptr, part_ptr, lock_ptr, split, num_splits, tile, size, MODE: tl.constexpr):
    """Store a tile's result acc at offsets ``offs`` of the (M, N) output (``size`` = M * N), per MODE (above).
    In "last" mode every program of the tile stores its partial, then (after a CTA barrier, so all its threads'
    stores precede it) bumps the tile's counter with acquire-release semantics at GPU scope; the program that
    sees num_splits - 1 sums the partials in split order (deterministic; read from L2, not a stale L1) and
    resets the counter to zero for the next launch (and CUDA-graph replay)."""
    if MODE == 0:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * size + offs, acc, mask=mask)
        if MODE == 2:
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                total = tl.zeros_like(acc)
                for s in range(0, num_splits):
                    total += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tile, 0)


_MAX_TILES = 1 << 16  # tiles one launch may have in "last" mode (the counters per device)
_locks: dict[torch.device, torch.Tensor] = {}


def _split_buffers(out: torch.Tensor, split: int, reduce: str, tiles: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(partials (split, M, N) float32 or ``out``, tile counters or ``out``, SPLIT_MODE) for a launch. "last"
    needs the zeroed counters of out's device, made outside CUDA-graph capture (a buffer made during capture
    would be zeroed only by replays); while capturing before they exist, and past _MAX_TILES, it is "launch"."""
    if split == 1:
        return out, out, _ONE_SPLIT
    part = torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)
    locks = _split_locks(out.device) if reduce == "last" and tiles <= _MAX_TILES else None
    return (part, locks, _SUM_LAST) if locks is not None else (part, out, _SUM_LAUNCH)


def _split_locks(device: torch.device) -> torch.Tensor | None:
    """The zeroed tile counters of ``device`` for "last"-mode split sums, made on first use outside CUDA-graph
    capture (a buffer made during capture would be zeroed only by replays); None while capturing before then."""
    locks = _locks.get(device)
    if locks is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        locks = _locks[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return locks


def _prefetches(device: torch.device, k: int) -> bool:
    """Whether ``fp8_gemm_blockwise`` bulk-prefetches its weight rows into L2 before waiting on the previous
    kernel: under programmatic dependent launch (sm_90+), when rows of K bytes keep 16-byte alignment."""
    return use_pdl(device) and k % 16 == 0


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (queried once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@attrs.frozen
class SmallMConfig:
    """Launch shape of ``fp8_gemm_small_m``.

    block_n: weight rows per program (16 to 128, a power of two: one 128-row scale block holds whole tiles);
    block_k: K columns per loop step (a multiple of 128, a power of two); split_k: programs sharing a row tile's K
    range, each writing a float32 partial that a second kernel sums in order (1: no partials); num_warps,
    num_stages: Triton's; swap: the weight tile as the dot's left operand; convert: how e4m3 becomes bf16 ("asm":
    inline PTX bit moves staged through shared memory, "asm_hoisted": the same in the dot's register layout, "bits":
    the moves in Triton ops, "cast": Triton's conversion, one cvt per weight); reduce: how
    splits are summed ("last": by the tile's last program, "launch": by a second kernel)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True
    convert: str = "asm"
    reduce: str = "last"

    def check(self) -> None:
        """ValueError naming the field out of its range."""
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"SmallMConfig.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.block_k not in (128, 256, 512, 1024):
            raise ValueError(f"SmallMConfig.block_k must be 128, 256, 512 or 1024, got {self.block_k}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(
                f"SmallMConfig needs split_k >= 1, num_warps in 1..8 (power of 2), num_stages >= 1: {self}"
            )
        if self.convert not in CONVERTS:
            raise ValueError(f"SmallMConfig.convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.reduce not in SPLIT_REDUCES:
            raise ValueError(f"SmallMConfig.reduce must be one of {SPLIT_REDUCES}, got {self.reduce!r}")


@functools.lru_cache(maxsize=4096)
def pick_small_m_config(m: int, n: int, k: int, device: torch.device) -> SmallMConfig:
    """The launch shape for M tokens of an (N, K) weight: the ``TUNED_STREAM`` entry when there is one, else
    64-row tiles of 256 columns and enough K splits for >= 2 programs per SM (at most one split per two
    256-column steps; Qwen3-8B on 132 SMs: gate_up 384 tiles -> 1 split, qkv 96 -> 3, o and down 64 -> 5)."""
    tuned = _tuned(TUNED_STREAM, m, n, k) if device.type == "cuda" else None
    if tuned is not None:
        return tuned
    target = 2 * (_num_sms(device.index or 0) if device.type == "cuda" else 132)
    cfg = SmallMConfig(convert="asm" if device.type == "cuda" else "bits")
    tiles, steps = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    split = max(1, min(triton.cdiv(target, tiles), steps // 2))
    return attrs.evolve(cfg, split_k=split)


def _tuned(table: dict[tuple[int, int, int], _Config], m: int, n: int, k: int) -> _Config | None:
    """The entry of ``table`` for (n, k) with the fewest "up to" tokens that still covers m, or None."""
    covering = [(up_to, cfg) for (tn, tk, up_to), cfg in table.items() if (tn, tk) == (n, k) and up_to >= m]
    return min(covering, key=lambda entry: entry[0])[1] if covering else None


def fp8_gemm_small_m(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: SmallMConfig | None = None
) -> torch.Tensor:
    """x (M, K) 16-bit, M <= SMALL_M @ dequantized(w (N, K) fp8).T -> (M, N) in x's dtype (see the module
    docstring). config: tile and split choice (None = ``pick_small_m_config``)."""
    m, k, n = _check_gemm_args(x, w, w_scale)
    cfg = config or pick_small_m_config(m, n, k, x.device)
    cfg.check()
    if m > SMALL_M:
        raise ValueError(f"fp8_gemm_small_m takes M <= {SMALL_M} tokens, got M={m}")
    per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, per_split)  # no empty split
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, cfg.block_n)
    part, locks, mode = _split_buffers(out, split, cfg.reduce, tiles)
    interpreted = upcast_dot(x.device)
    _stream_kernel[(tiles, split)](
        x, w, w_scale, out, part, locks,
        m, n, k, x.stride(0), w_scale.stride(0), per_split, split,
        SPLIT_MODE=mode, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SWAP=cfg.swap, BITS=cfg.convert != "cast", ASM=cfg.convert.startswith("asm") and not interpreted,
        ASM_HOISTED=cfg.convert == "asm_hoisted", UPCAST=interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if mode == _SUM_LAUNCH:
        _sum_splits(part, out)
    return out


def _sum_splits(part: torch.Tensor, out: torch.Tensor) -> None:
    """out (M, N) = part (S, M, N) float32 summed over S in order (deterministic), rounded to out's dtype."""
    split, m, n = part.shape
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](
        part, out, out, m, n, out.stride(0), HAS_BIAS=False, SPLIT=split, BLOCK=block
    )


# ---- large M: fp8 tensor cores ----------------------------------------------------------------------------------


@triton.jit
def _quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, K, GROUPS, stride_xm, stride_qm, stride_sm,
    GROUPS_PER_PROGRAM: tl.constexpr, ROUND_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """GROUPS_PER_PROGRAM (token, 128-column group)s of one token: scale = max(amax / 448, 1e-12); q = x / scale
    in e4m3. ROUND_FIRST (the interpreter only, whose float32 -> e4m3 conversion drops the carry of a rounding
    that crosses a power of two: 126.25 -> 64) rounds to the e4m3 grid in float32 first, so the conversion is
    exact."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    k = groups[:, None] * 128 + tl.arange(0, 128)[None, :]  # (GROUPS_PER_PROGRAM, 128)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, ROUND_FIRST)
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < GROUPS)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel of ``quantize_activations_ref``: (x_q (M, K) fp8, x_scale (M, ceil(K / 128)) float32); one
    program per token and 8 column groups (1,024 values)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    groups = triton.cdiv(k, 128)
    x_q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    per_program = 8
    if m:
        _quantize_activations_kernel[(m, triton.cdiv(groups, per_program))](
            x, x_q, x_scale, k, groups, x.stride(0), x_q.stride(0), x_scale.stride(0),
            GROUPS_PER_PROGRAM=per_program, ROUND_FIRST=upcast_dot(x.device),
            USE_PDL=use_pdl(x.device), **pdl_launch(x.device),
        )  # fmt: skip
    return x_q, x_scale


# 128-column blocks of its weight rows a program prefetches into L2 before waiting on the previous kernel: enough
# to cover its pipeline's start; a first wave of ~264 programs x 128 rows x 512 bytes (17 MB) stays well inside L2.
_PREFETCH_BLOCKS = tl.constexpr(4)


@triton.jit
def _prefetch_split(w_ptr, offs_n, N, K, first, K_BLOCKS_PER_SPLIT):
    """Prefetch into L2 the first _PREFETCH_BLOCKS 128-column blocks, from block ``first`` on, of the weight
    rows offs_n (rows past N read row N - 1's)."""
    end = tl.minimum(K, (first + tl.minimum(K_BLOCKS_PER_SPLIT, _PREFETCH_BLOCKS)) * 128)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    _prefetch_rows_l2(w_ptr + rows * K + first * 128, tl.zeros_like(offs_n) + (end - first * 128))


@triton.jit
def _prefetch_rows_l2(row_ptrs, nbytes):
    """Ask for ``nbytes`` (a multiple of 16) from each 16-byte aligned address row_ptrs (a tensor of byte
    pointers) to be brought into L2 (sm_90 bulk prefetch; no registers, no wait). Issued before waiting on the
    previous kernel under programmatic dependent launch, so a GEMM's first weight bytes stream in while the
    kernel before it finishes."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
        "=r,l,r",
        [row_ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _blockwise_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_am, stride_asm, stride_wsn, K_BLOCKS_PER_SPLIT, NUM_SPLITS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_MODE: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_L2: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) output tile over the 128-deep K blocks of split program_id(1): sum of (a block @
    w block.T) * a_scale[m, kb] * w_scale[n // 128, kb], tiles walked in groups of GROUP_M row tiles so programs
    running together share weight tiles in L2; the splits' partials are summed per SPLIT_MODE (``_write_tile``)."""
    pid, split = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    ws_row = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn  # BLOCK_N <= 128: one scale block row per tile
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn  # BLOCK_N > 128: a scale per row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * K_BLOCKS_PER_SPLIT
    if PREFETCH_L2:  # the split's first weight blocks, before waiting on the kernel that writes a
        _prefetch_split(w_ptr, offs_n, N, K, first, K_BLOCKS_PER_SPLIT)
    wait_for_previous_kernel(USE_PDL)
    for kb in range(first, tl.minimum(first + K_BLOCKS_PER_SPLIT, tl.cdiv(K, 128))):
        k = kb * 128 + offs_k
        a_mask = (offs_m[:, None] < M) & (k[None, :] < K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (k[None, :] < K)  # zeros past K: garbage e4m3 bytes may be NaN
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], mask=w_mask, other=0.0)
        a_scale = tl.load(as_ptr + offs_m * stride_asm + kb, mask=offs_m < M, other=0.0)
        if UPCAST:  # the interpreter: exact in float32
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # fp8 x fp8 on the tensor cores, float32 accumulation
            part = tl.dot(a, tl.trans(w))
        if BLOCK_N > 128:  # noqa: SIM108 (a scale per row here, one scalar otherwise)
            w_scale = tl.load(ws_rows + kb, mask=offs_n < N, other=0.0)[None, :]
        else:
            w_scale = tl.load(ws_row + kb)
        acc += part * (a_scale[:, None] * w_scale)
    offs, mask = offs_m[:, None] * N + offs_n[None, :], (offs_m[:, None] < M) & (offs_n[None, :] < N)
    _write_tile(acc, offs, mask, out_ptr, part_ptr, lock_ptr, split, NUM_SPLITS, pid, M * N, SPLIT_MODE)


@attrs.frozen
class BlockwiseConfig:
    """Launch shape of ``fp8_gemm_blockwise``: token rows (16 to 256) and weight rows (16 to 256) per program
    (powers of two), row tiles per L2 group, K splits and how they are summed (as ``SmallMConfig``), Triton's
    warps and stages."""

    block_m: int = 64
    block_n: int = 128
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 3
    reduce: str = "last"

    def check(self) -> None:
        """ValueError naming the field out of its range."""
        if self.block_m not in (16, 32, 64, 128, 256) or self.block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"BlockwiseConfig needs block_m and block_n in 16..256 (powers of two): {self}")
        if self.group_m < 1 or self.split_k < 1 or self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(
                f"BlockwiseConfig needs group_m >= 1, split_k >= 1, num_warps in 1..8 (power of 2), num_stages >= 1:"
                f" {self}"
            )
        if self.reduce not in SPLIT_REDUCES:
            raise ValueError(f"BlockwiseConfig.reduce must be one of {SPLIT_REDUCES}, got {self.reduce!r}")


@functools.lru_cache(maxsize=4096)
def pick_blockwise_config(m: int, n: int, k: int, device: torch.device) -> BlockwiseConfig:
    """The launch shape for M tokens of an (N, K) weight: the ``TUNED_BLOCKWISE`` entry when there is one, else
    (64 tokens up to 512, else 128) x 128 rows, 8 warps, 3 stages, one split."""
    tuned = _tuned(TUNED_BLOCKWISE, m, n, k) if device.type == "cuda" else None
    if tuned is not None:
        return tuned
    return BlockwiseConfig(block_m=64 if m <= 512 else 128)


def fp8_gemm_blockwise(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    block_m: int | None = None,
    group_m: int | None = None,
    config: BlockwiseConfig | None = None,
) -> torch.Tensor:
    """Quantized activations (``quantize_activations``) @ dequantized(w).T -> (M, N) in ``dtype``, on the fp8
    tensor cores (see the module docstring); the kernel of ``fp8_blockwise_ref``. config: the launch shape (None:
    ``pick_blockwise_config``); block_m / group_m, when given, replace its fields."""
    m, k, n = _check_gemm_args(x_q, w, w_scale)
    cfg = config or pick_blockwise_config(m, n, k, x_q.device)
    cfg = attrs.evolve(cfg, block_m=block_m or cfg.block_m, group_m=group_m or cfg.group_m)
    cfg.check()
    if tuple(x_scale.shape) != (m, triton.cdiv(k, 128)):
        raise ValueError(f"x_scale must be (M, ceil(K / 128)) = ({m}, {triton.cdiv(k, 128)}), got {x_scale.shape}")
    k_blocks = triton.cdiv(k, 128)
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    split = triton.cdiv(k_blocks, per_split)  # no empty split
    out = torch.empty((m, n), dtype=dtype, device=x_q.device)
    if m == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part, locks, mode = _split_buffers(out, split, cfg.reduce, tiles)
    _blockwise_kernel[(tiles, split)](
        x_q, x_scale, w, w_scale, out, part, locks,
        m, n, k, x_q.stride(0), x_scale.stride(0), w_scale.stride(0), per_split, split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, SPLIT_MODE=mode,
        UPCAST=upcast_dot(x_q.device), USE_PDL=use_pdl(x_q.device), PREFETCH_L2=_prefetches(x_q.device, k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x_q.device),
    )  # fmt: skip
    if mode == _SUM_LAUNCH:
        _sum_splits(part, out)
    return out


# Token count and split sizes are not specialized on (1, multiples of 16): one compiled kernel per launch shape
# serves every M and every weight of a model (they only bound masks and loops), so warm-up and the sweep compile once.
@triton.jit(do_not_specialize=["M", "K_BLOCKS_PER_SPLIT", "NUM_SPLITS"])
def _swap_fp8_kernel(
    a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_am, stride_asm, stride_wsn, K_BLOCKS_PER_SPLIT, NUM_SPLITS,
    SPLIT_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, QUANT_A: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_L2: tl.constexpr,
    TMA: tl.constexpr, PRELOAD: tl.constexpr, TILE_MAJOR: tl.constexpr = False,
):  # fmt: skip
    """One (BLOCK_N weight rows, BLOCK_T tokens, K range) tile with the weight on the dot's left (so a few tokens
    fill the narrow side of Hopper's wgmma): sum over 128-deep K blocks of (w block @ a block.T) * w_scale *
    a_scale[token, kb], written transposed to out[token, row]. The token tiles of one row tile are neighbours in
    the launch order (axis 0), so they run together and read the weight tile from HBM once. QUANT_A: a is the
    16-bit activations, quantized here per (token, 128 columns) exactly as ``quantize_activations`` does (one
    launch fewer; each row tile redoes it, cheap for a few tokens). USE_PDL: wait on the previous kernel (under
    programmatic dependent launch) before reading a; PREFETCH_L2: before that wait, ask L2 for the split's first
    weight blocks (no earlier kernel writes them); TMA: load the weight tiles through the tensor descriptor
    w_desc (block (BLOCK_N, 128); zeros past N and K) instead of pointer loads from w_ptr. PRELOAD (0, 1 or 2):
    load the split's first PRELOAD weight blocks into registers before that wait, and their activation blocks
    right after it; the loop runs over the split's other blocks, and the preloaded blocks are added last (so
    the sum's order, not its terms, differs from PRELOAD 0: equal up to float32 rounding). TILE_MAJOR: w_ptr /
    w_desc hold the weight as ``tile_major_weight(w, BLOCK_N)`` lays it out (each (BLOCK_N, 128) tile's 8 KB
    contiguous, a row tile's K blocks one after another), not as (N, K) rows; the same products and sums."""
    pid_t, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    ws_row = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn  # BLOCK_N > 128: one scale per 128 rows
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    first = split * K_BLOCKS_PER_SPLIT
    end = tl.minimum(first + K_BLOCKS_PER_SPLIT, tl.cdiv(K, 128))  # every split has >= 1 block (_launch_swap)
    if PREFETCH_L2:
        _prefetch_split(w_ptr, offs_n, N, K, first, K_BLOCKS_PER_SPLIT)
    if PRELOAD >= 1:  # weights: no kernel writes them, so they may be read before the wait
        w_first = _swap_weight_tile(w_ptr, w_desc, offs_n, N, K, first, pid_n * BLOCK_N, TMA, TILE_MAJOR)
    if PRELOAD >= 2:  # (block first + 1 may lie past this split: read, and not added below)
        w_second = _swap_weight_tile(w_ptr, w_desc, offs_n, N, K, first + 1, pid_n * BLOCK_N, TMA, TILE_MAJOR)
    wait_for_previous_kernel(USE_PDL)
    if PRELOAD >= 1:  # their activations, asked for now so they arrive while the loop runs
        a_first, as_first = _swap_act_tile(a_ptr, as_ptr, offs_t, M, K, first, stride_am, stride_asm, QUANT_A, UPCAST)
    if PRELOAD >= 2:
        a_second, as_second = _swap_act_tile(
            a_ptr, as_ptr, offs_t, M, K, first + 1, stride_am, stride_asm, QUANT_A, UPCAST
        )
    for kb in range(first + PRELOAD, end):
        w = _swap_weight_tile(w_ptr, w_desc, offs_n, N, K, kb, pid_n * BLOCK_N, TMA, TILE_MAJOR)
        a, a_scale = _swap_act_tile(a_ptr, as_ptr, offs_t, M, K, kb, stride_am, stride_asm, QUANT_A, UPCAST)
        acc = _swap_accumulate(acc, w, a, a_scale, kb, ws_row, ws_rows, offs_n, N, BLOCK_N, UPCAST)
    if PRELOAD >= 1:
        acc = _swap_accumulate(acc, w_first, a_first, as_first, first, ws_row, ws_rows, offs_n, N, BLOCK_N, UPCAST)
    if PRELOAD >= 2:  # noqa: SIM102 (a compile-time test around a run-time one: w_second exists only here)
        if first + 1 < end:
            acc = _swap_accumulate(
                acc, w_second, a_second, as_second, first + 1, ws_row, ws_rows, offs_n, N, BLOCK_N, UPCAST
            )
    offs, mask = offs_t[None, :] * N + offs_n[:, None], (offs_n[:, None] < N) & (offs_t[None, :] < M)
    tile = pid_n * tl.num_programs(0) + pid_t
    _write_tile(acc, offs, mask, out_ptr, part_ptr, lock_ptr, split, NUM_SPLITS, tile, M * N, SPLIT_MODE)


@triton.jit
def _swap_weight_tile(w_ptr, w_desc, offs_n, N, K, kb, row0, TMA: tl.constexpr, TILE_MAJOR: tl.constexpr = False):
    """The (BLOCK_N, 128) e4m3 weight tile of rows offs_n (starting at row0) and K block kb: by the TMA
    descriptor (zeros past N and K) or by pointer loads (masked the same). TILE_MAJOR: the weight is laid out by
    ``tile_major_weight`` (zero-padded, so no masks): the tile is the 8 KB at tile row row0 * K blocks + kb *
    BLOCK_N."""
    if TILE_MAJOR:
        first_row = row0 * tl.cdiv(K, 128) + kb * offs_n.shape[0]
        if TMA:
            w = w_desc.load([first_row, 0])
        else:
            rows = (first_row + tl.arange(0, offs_n.shape[0])).to(tl.int64)
            w = tl.load(w_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :])
    elif TMA:
        w = w_desc.load([row0, kb * 128])
    else:
        k = kb * 128 + tl.arange(0, 128)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :],
                    mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0.0)  # fmt: skip
    return w


@triton.jit
def _swap_act_tile(a_ptr, as_ptr, offs_t, M, K, kb, stride_am, stride_asm, QUANT_A: tl.constexpr, UPCAST):
    """(e4m3 activations (BLOCK_T, 128) of tokens offs_t at K block kb, their per-token scales): loaded, or with
    QUANT_A quantized here from the 16-bit activations."""
    k = kb * 128 + tl.arange(0, 128)
    a = tl.load(a_ptr + offs_t[:, None] * stride_am + k[None, :],
                mask=(offs_t[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
    if QUANT_A:
        a, a_scale = _quantize_tile(a, UPCAST)
    else:
        a_scale = tl.load(as_ptr + offs_t * stride_asm + kb, mask=offs_t < M, other=0.0)
    return a, a_scale


@triton.jit
def _swap_accumulate(acc, w, a, a_scale, kb, ws_row, ws_rows, offs_n, N, BLOCK_N: tl.constexpr, UPCAST):
    """acc + (w @ a.T) * a_scale[token] * w_scale[row block, kb]: one 128-deep K block of the swap product."""
    if UPCAST:  # the interpreter: exact in float32
        part = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    else:  # fp8 x fp8 on the tensor cores, float32 accumulation
        part = tl.dot(w, tl.trans(a))
    if BLOCK_N > 128:  # noqa: SIM108 (a scale per row here, one scalar otherwise)
        w_scale = tl.load(ws_rows + kb, mask=offs_n < N, other=0.0)[:, None]
    else:
        w_scale = tl.load(ws_row + kb)
    return acc + part * (a_scale[None, :] * w_scale)


@triton.jit
def _quantize_tile(x, ROUND_FIRST: tl.constexpr):
    """(e4m3 x / scale, scale) for a (tokens, 128) tile, one scale per token (``quantize_groups``, the arithmetic
    of ``_quantize_activations_kernel``; ROUND_FIRST as there)."""
    q, scale = quantize_groups(x.to(tl.float32), ROUND_FIRST)
    return q.to(tl.float8e4nv), scale


@attrs.frozen
class SwapConfig:
    """Launch shape of ``fp8_gemm_swap``: weight rows per program (16 to 256, power of two), tokens per program
    (16 to 256, power of two), K splits and how they are summed (as ``SmallMConfig``), Triton's warps and stages.

    Kernel-side levers (off by default, today's kernel): pdl: launched under programmatic dependent launch, the
    kernel waits on the one before it only before reading activations (where the GPU has it, else ignored);
    prefetch: with pdl, before that wait each program asks L2 for its split's first weight blocks; tma: weight
    tiles by a TMA tensor descriptor (Triton's host ``TensorDescriptor``) instead of pointer loads. prefetch and
    tma need 16-byte weight rows (K a multiple of 16, an aligned base); elsewhere the kernel runs without them
    (same result). preload (0, 1 or 2): each program reads its split's first ``preload`` weight blocks into
    registers before the PDL wait (so they stream in while the kernel before finishes) and adds them after its
    loop; without pdl they are read first all the same (no overlap). ``pick_swap_config`` turns pdl and tma on up
    to SWAP_MAX_M tokens (measured faster)."""

    block_n: int = 128
    block_t: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    reduce: str = "last"
    pdl: bool = False
    prefetch: bool = False
    tma: bool = False
    preload: int = 0

    def check(self) -> None:
        """ValueError naming the field out of its range."""
        if self.block_n not in (16, 32, 64, 128, 256) or self.block_t not in (16, 32, 64, 128, 256):
            raise ValueError(f"SwapConfig needs block_n and block_t in 16..256 (powers of two): {self}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(f"SwapConfig needs split_k >= 1, num_warps in 1..8 (power of 2), num_stages >= 1: {self}")
        if self.reduce not in SPLIT_REDUCES:
            raise ValueError(f"SwapConfig.reduce must be one of {SPLIT_REDUCES}, got {self.reduce!r}")
        if self.prefetch and not self.pdl:
            raise ValueError(f"SwapConfig.prefetch needs pdl=True (it runs before the PDL wait): {self}")
        if self.preload not in (0, 1, 2):
            raise ValueError(f"SwapConfig.preload must be 0, 1 or 2 (weight blocks read before the wait): {self}")


@functools.lru_cache(maxsize=4096)
def pick_swap_config(m: int, n: int, k: int, device: torch.device) -> SwapConfig:
    """The launch shape for M tokens of an (N, K) weight: the ``TUNED_SWAP`` entry when there is one; else up to
    SWAP_MAX_M tokens what every swept best shared (H200): 64-row tiles of 16 tokens, PDL, TMA weight tiles, the
    splits summed by a second launch, and K splits for ~4 programs per SM unless the tiles alone give 2 (at most
    one split per four K blocks); above, 128-row tiles, all M tokens in one tile up to 128 (else tiles of 128; 8
    warps for 128 x 128 tiles), then enough K splits for >= 2 programs per SM (as many K blocks per split)."""
    tuned = _tuned(TUNED_SWAP, m, n, k) if device.type == "cuda" else None
    if tuned is not None:
        return tuned
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
    if m <= SWAP_MAX_M:  # the pattern of every measured best (TUNED_SWAP)
        tiles = triton.cdiv(n, 64) * triton.cdiv(m, 16)
        split = 1 if tiles >= 2 * sms else max(1, min(triton.cdiv(4 * sms, tiles), triton.cdiv(k, 128) // 4))
        return SwapConfig(64, 16, split, num_warps=4, num_stages=4, reduce="launch", pdl=True, tma=True)
    target = 2 * sms
    block_t = min(128, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, block_t)
    split = max(1, min(triton.cdiv(target, tiles), triton.cdiv(k, 128) // 4))
    return SwapConfig(128, block_t, split, num_warps=8 if block_t >= 128 else 4)


# Launch shapes measured best on an H200 (benchmarks/bench_fp8_gemm.py --sweep, which prints these tables), keyed by
# (N, K, up to M tokens): a product takes its (N, K)'s entry with the fewest tokens >= its M; other shapes, and
# other GPUs' first calls, take the pick functions' rules.
TUNED_STREAM: dict[tuple[int, int, int], SmallMConfig] = {}
# TUNED_SWAP: H200, bench_fp8_gemm.py --sweep --sweep-kernels swap swap_fused --ms 16 1 4 32 (branch h-f8s at
# df7e7f5), µs per GEMM with its quantization launch, swept vs before (pick_swap_config's old rule, no levers):
# qkv 10.3 / 11.1 vs 13.7 / 14.5 at M = 1 / 16, o 8.4 / 9.3 vs 11.0 / 12.1, gate_up 27.6 / 28.8 vs 31.3 / 33.1,
# down 17.1 / 18.8 vs 20.4 / 22.1; per layer 63.4 / 68.0 us (3.04 / 2.84 TB/s of fp8 bytes) vs 75.8 / 81.4.
_SWAP = functools.partial(SwapConfig, 64, 16, num_warps=4, reduce="launch")  # 64 x 16 tiles, second-launch sum
TUNED_SWAP: dict[tuple[int, int, int], SwapConfig] = {
    (6144, 4096, 1): _SWAP(split_k=4, num_stages=5, pdl=True, tma=True),  # qkv 10.3 us
    (6144, 4096, 4): _SWAP(split_k=4, num_stages=4, pdl=True, tma=True),  # qkv 10.2 us
    (6144, 4096, 16): _SWAP(split_k=4, num_stages=5, pdl=True),  # qkv 11.1 us
    (6144, 4096, 32): SwapConfig(64, 32, 4, num_warps=4, num_stages=3, reduce="launch", pdl=True),  # qkv 12.0 us
    (4096, 4096, 1): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # o 8.4 us
    (4096, 4096, 4): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # o 8.4 us
    (4096, 4096, 16): _SWAP(split_k=4, num_stages=4, tma=True),  # o 9.3 us
    (4096, 4096, 32): _SWAP(split_k=3, num_stages=4, pdl=True, tma=True),  # o 9.4 us
    (24576, 4096, 1): _SWAP(split_k=1, num_stages=5, pdl=True, tma=True),  # gate_up 27.6 us
    (24576, 4096, 4): _SWAP(split_k=1, num_stages=5, pdl=True, tma=True),  # gate_up 29.0 us
    (24576, 4096, 16): _SWAP(split_k=1, num_stages=6, pdl=True, tma=True),  # gate_up 28.8 us
    (24576, 4096, 32): _SWAP(split_k=1, num_stages=3, pdl=True, tma=True),  # gate_up 31.9 us
    (4096, 12288, 1): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # down 17.1 us
    (4096, 12288, 4): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # down 17.5 us
    (4096, 12288, 16): _SWAP(split_k=8, num_stages=4, tma=True),  # down 18.8 us
    (4096, 12288, 32): _SWAP(split_k=6, num_stages=3, pdl=True, tma=True),  # down 20.2 us
}
# TUNED_SWAP_READY: the swap kernel's launch shapes when its activations come quantized by their producer
# (``fp8_linear_prepared`` / ``fp8_linear_partials``, FNVLLM_FP8_FUSED_QUANT on; other shapes and M take TUNED_SWAP).
# H200, bench_fp8_gemm.py --sweep --sweep-kernels swap_ready --ms 1 16 (branch h-f8q at 0b7e81c, 55 s budget), µs
# per GEMM from ready fp8 activations, swept vs TUNED_SWAP's shape in the same run: qkv 9.6 / 9.9 vs 9.8 / 10.5
# at M = 1 / 16, o 7.8 / 8.1 vs 7.8 / 8.6, down 16.1 / 17.1 vs 16.1 / 18.0; per layer 60.6 / 63.0 us (3.19 / 3.06
# TB/s) vs 61.8 / 64.4. gate_up's swept best (27.0 us at M = 1 without PDL and TMA, 27.9 at 16) is within the
# run's noise of TUNED_SWAP's (28.1 / 27.4 in its timing pass), so it keeps TUNED_SWAP's; o has no producer (its
# input comes from attention), so it keeps TUNED_SWAP's too. Every entry keeps TUNED_SWAP's K split at the M it
# covers, so the fused path sums the same partials in the same order (bit-identical results). As before, the
# split sum by a second launch beat the tile's last program everywhere (at M = 1: qkv 9.8 vs 11.1, o 7.8 vs
# 10.0, down 16.2 vs 18.5 us).
TUNED_SWAP_READY: dict[tuple[int, int, int], SwapConfig] = {
    (6144, 4096, 1): _SWAP(split_k=4, num_stages=4, pdl=True, tma=True),  # qkv 9.6 us
    (6144, 4096, 16): _SWAP(split_k=4, num_stages=4, pdl=True, tma=True),  # qkv 9.9 us
    (4096, 12288, 1): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # down 16.1 us
    (4096, 12288, 16): _SWAP(split_k=8, num_stages=3, pdl=True, tma=True),  # down 17.1 us
}


def pick_ready_swap_config(m: int, n: int, k: int, device: torch.device) -> SwapConfig:
    """The swap kernel's launch shape for M tokens of an (N, K) weight from ready fp8 activations: the
    TUNED_SWAP_READY entry when there is one (on CUDA), else ``pick_swap_config``'s."""
    tuned = _tuned(TUNED_SWAP_READY, m, n, k) if device.type == "cuda" else None
    return tuned if tuned is not None else pick_swap_config(m, n, k, device)


TUNED_BLOCKWISE: dict[tuple[int, int, int], BlockwiseConfig] = {
    (4096, 4096, 64): BlockwiseConfig(block_m=64, block_n=128, split_k=3, num_warps=4, num_stages=5),  # o
    (24576, 4096, 64): BlockwiseConfig(block_m=64, block_n=128, split_k=1, num_warps=8, num_stages=4),  # gate_up
    (4096, 12288, 64): BlockwiseConfig(block_m=64, block_n=128, split_k=3, num_warps=8, num_stages=5),  # down
}


def fp8_gemm_swap(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    config: SwapConfig | None = None,
    w_tiles: TileMajorWeight | None = None,
) -> torch.Tensor:
    """Quantized activations @ dequantized(w).T -> (M, N) in ``dtype`` with the weight on the dot's left and
    split-K (``_swap_fp8_kernel``): for up to a few hundred tokens, where ``fp8_gemm_blockwise``'s 128-wide
    output tiles leave SMs idle. The kernel of ``fp8_blockwise_ref``. w_tiles: w as ``tile_major_weight(w,
    the launch shape's block_n)`` lays it out, which the kernel then reads instead of w (a probe of the weight's
    layout: the same result, bit for bit; no L2 prefetch; another block_n is a ValueError)."""
    m, k, _ = _check_gemm_args(x_q, w, w_scale)
    if tuple(x_scale.shape) != (m, triton.cdiv(k, 128)):
        raise ValueError(f"x_scale must be (M, ceil(K / 128)) = ({m}, {triton.cdiv(k, 128)}), got {x_scale.shape}")
    return _launch_swap(x_q, x_scale, w, w_scale, dtype, config, w_tiles=w_tiles)


class TileMajorWeight(NamedTuple):
    """An e4m3 weight as ``tile_major_weight`` lays it out: the (tiles * K blocks * block_n, 128) bytes and the
    row tile they are cut for (a swap launch must use the same block_n)."""

    tiles: torch.Tensor
    block_n: int


def tile_major_weight(w: torch.Tensor, block_n: int) -> TileMajorWeight:
    """An (N, K) e4m3 weight laid out for ``fp8_gemm_swap(..., w_tiles=)`` at row tiles of ``block_n``: zero-padded
    to (ceil(N / block_n) * block_n, ceil(K / 128) * 128), cut into (block_n, 128) tiles, each tile's bytes
    contiguous, a row tile's K blocks one after another -> (row tiles * K blocks * block_n, 128). So a program of
    the swap kernel streams one contiguous range where the (N, K) layout gives it block_n 128-byte pieces K bytes
    apart. Worked example: N = 4, K = 256, block_n = 2: rows 0-1 of K block 0, rows 0-1 of K block 1, rows 2-3 of
    K block 0, rows 2-3 of K block 1."""
    if w.dim() != 2 or w.dtype != FP8_DTYPE:
        raise ValueError(f"w must be a 2-D {FP8_DTYPE} weight, got {w.dtype} {tuple(w.shape)}")
    if block_n < 1:
        raise ValueError(f"block_n must be >= 1 (the kernel's row tile: 16..256), got {block_n}")
    (n, k), tiles, blocks = w.shape, triton.cdiv(w.shape[0], block_n), triton.cdiv(w.shape[1], 128)
    padded = torch.zeros((tiles * block_n, blocks * 128), dtype=torch.uint8, device=w.device)
    padded[:n, :k] = w.view(torch.uint8)
    laid = padded.view(tiles, block_n, blocks, 128).permute(0, 2, 1, 3).contiguous()
    return TileMajorWeight(laid.view(tiles * blocks * block_n, 128).view(FP8_DTYPE), block_n)


def fp8_gemm_swap_bf16(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: SwapConfig | None = None
) -> torch.Tensor:
    """``fp8_gemm_swap`` on 16-bit activations x (M, K), quantized per (token, 128 columns) inside the kernel
    (``quantize_activations``' arithmetic, no launch of its own) -> (M, N) in x's dtype. The same numerics as
    ``fp8_blockwise_ref(*quantize_activations(x), ...)``."""
    _check_gemm_args(x, w, w_scale, x_dtypes=_KERNEL_DTYPES)
    return _launch_swap(x, None, w, w_scale, x.dtype, config)


def _launch_swap(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    config: SwapConfig | None,
    keep_partials: bool = False,
    w_tiles: TileMajorWeight | None = None,
) -> torch.Tensor:
    """Launch ``_swap_fp8_kernel`` on fp8 a with its scales, or on 16-bit a (a_scale None: quantized inside).
    keep_partials: return the splits' float32 partials (S, M, N) unsummed (every split stores one, also S = 1).
    w_tiles: w laid out by ``tile_major_weight`` at the launch shape's block_n, read in its place."""
    (m, k), n = a.shape, w.shape[0]
    cfg = config or pick_swap_config(m, n, k, a.device)
    cfg.check()
    if w_tiles is not None:
        want = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, 128) * cfg.block_n, 128)
        if w_tiles.block_n != cfg.block_n or tuple(w_tiles.tiles.shape) != want:
            raise ValueError(
                f"w_tiles must be tile_major_weight(w, {cfg.block_n}) ({want}), got block_n {w_tiles.block_n},"
                f" {tuple(w_tiles.tiles.shape)}"
            )
        w = w_tiles.tiles
    aligned = (k % 16 == 0 or w_tiles is not None) and w.data_ptr() % 16 == 0  # TMA, bulk prefetch: 16-byte rows
    tma = cfg.tma and aligned and TensorDescriptor is not None  # else pointer loads (same result)
    k_blocks = triton.cdiv(k, 128)
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    split = triton.cdiv(k_blocks, per_split)
    shape = (split, m, n) if keep_partials else (m, n)
    out = torch.empty(shape, dtype=torch.float32 if keep_partials else dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_t), triton.cdiv(n, cfg.block_n), split)
    if keep_partials:  # the kernel stores each split's partial and nothing sums them
        part, locks, mode = out, out, _SUM_LAUNCH
    else:
        part, locks, mode = _split_buffers(out, split, cfg.reduce, grid[0] * grid[1])
    scales = out if a_scale is None else a_scale
    pdl = cfg.pdl and use_pdl(a.device)
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, 128]) if tma else w
    _swap_fp8_kernel[grid](
        a, scales, w, w_desc, w_scale, out, part, locks,
        m, n, k, a.stride(0), scales.stride(0), w_scale.stride(0), per_split, split,
        SPLIT_MODE=mode, BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, QUANT_A=a_scale is None,
        UPCAST=upcast_dot(a.device), USE_PDL=pdl, PREFETCH_L2=pdl and cfg.prefetch and aligned and w_tiles is None,
        TMA=tma, PRELOAD=cfg.preload, TILE_MAJOR=w_tiles is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **(pdl_launch(a.device) if pdl else {}),
    )  # fmt: skip
    if mode == _SUM_LAUNCH and not keep_partials:
        _sum_splits(part, out)
    return out


def fp8_gemm_swap_partials(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: SwapConfig | None = None
) -> torch.Tensor:
    """``fp8_gemm_swap`` without its split sum: the float32 partial products (S, M, N) of its S K splits (S from the
    launch shape; S = 1 too), for a consumer that sums them in split order itself (``fused_ops.SplitPartials``:
    then out = the sum rounded to the output dtype, exactly what ``fp8_gemm_swap`` returns)."""
    m, k, _ = _check_gemm_args(x_q, w, w_scale)
    if tuple(x_scale.shape) != (m, triton.cdiv(k, 128)):
        raise ValueError(f"x_scale must be (M, ceil(K / 128)) = ({m}, {triton.cdiv(k, 128)}), got {x_scale.shape}")
    return _launch_swap(x_q, x_scale, w, w_scale, torch.float32, config, keep_partials=True)


def fp8_linear_partials(x: Fp8Activations, w: torch.Tensor, w_scale: torch.Tensor) -> SplitPartials:
    """``fp8_linear_prepared(x, w, w_scale)`` (no bias, up to SWAP_MAX_M tokens) left as its split partials
    (``fp8_gemm_swap_partials``)."""
    x_q, x_scale, dtype = x
    cfg = pick_ready_swap_config(x_q.shape[0], *w.shape, x_q.device)
    return SplitPartials(fp8_gemm_swap_partials(x_q, x_scale, w, w_scale, cfg), dtype)


# The (M, N) output of split partials x (S, M, N), summed in split order in x.dtype: the same kernel and order as
# ``fp8_gemm_swap``'s own sum (``_sum_splits``), shared with the skinny GEMM's partials.
sum_partials = sum_split_partials


def _check_gemm_args(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, x_dtypes: tuple[torch.dtype, ...] | None = None
) -> tuple[int, int, int]:
    """(M, K, N) after checking shapes, dtypes (x's among ``x_dtypes`` when given) and the contiguity the kernels
    index by."""
    if x_dtypes is not None and x.dtype not in x_dtypes:
        raise ValueError(f"x must be one of {x_dtypes}, got {x.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x (M, K) and w (N, K) must agree on K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.dtype != FP8_DTYPE or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"w must be contiguous {FP8_DTYPE} and x's rows contiguous, got {w.dtype}, {x.stride()}")
    n, k = w.shape
    blocks = (triton.cdiv(n, 128), triton.cdiv(k, 128))
    if tuple(w_scale.shape) != blocks or w_scale.dtype != torch.float32 or w_scale.stride(1) != 1:
        raise ValueError(f"w_scale must be float32 {blocks} with contiguous rows, got {w_scale.dtype} {w_scale.shape}")
    return x.shape[0], k, n


# ---- cuBLAS block-scaled GEMM (torch._scaled_mm) ---------------------------------------------------------------


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of ``multiple`` (cuBLASLt wants M in multiples of 4)."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def cublas_scale_layouts(x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors as cuBLAS's DeepSeek-style recipe (1 x 128 activations, 128 x 128 weights) reads them:
    activations (M, K/128) outer-dim-major (stride (1, M)); weights (N/128, K/128) with K/128 padded to a multiple of
    4, given as its transpose (K/128 padded, N/128) with stride (1, padded)."""
    a = x_scale.t().contiguous().t()
    k_blocks = w_scale.shape[1]
    b = F.pad(w_scale, (0, -k_blocks % 4)).t()
    return a, b


def scaled_mm_supported(n: int, k: int) -> bool:
    """Whether ``fp8_scaled_mm`` can take an (N, K) weight: whole 128 x 128 blocks (cuBLAS has no partial ones), and
    at least two 128-column groups (with one, torch reads the activation scale as a row-wise one)."""
    return n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0 and k >= 2 * SCALE_BLOCK


def fp8_scaled_mm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ dequantized(w).T with cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm``, sm_90 and
    CUDA >= 12.9): the activations quantized per (token, 128 columns) by ``quantize_activations``, the weight's
    128 x 128 block scales as stored (``weight_scale_inv`` multiplies). Same numerics as ``fp8_blockwise_ref``."""
    m = x.shape[0]
    x_q, x_scale = quantize_activations(x if x.stride(-1) == 1 else x.contiguous())
    x_q, x_scale = _pad_rows(x_q, 4), _pad_rows(x_scale, 4)
    scale_a, scale_b = cublas_scale_layouts(x_scale, w_scale)
    out = torch._scaled_mm(x_q, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    out = out[:m]
    return out if bias is None else out.add_(bias)


# ---- row-wise FP8 GEMM (per-token activation scales x per-row weight scales) -----------------------------------

# fp8_linear takes the row-wise GEMM for more tokens than ROWWISE_MIN_M (weights with a row scale), or than the
# weight's ROWWISE_MIN_M_BY_SHAPE entry. H200, benchmarks/bench_fp8_rowwise.py at 2ee1fb3 (torch 2.11), us per
# Qwen3-8B layer (four GEMMs) at M = 32 / 64 / 96 / 128 / 256 / 512 / 2048 / 8192: today's path (quantization
# included) 98.8 / 94.0 / 115.4 / 116.1 / 134.6 / 206.1 / 741.3 / 2,912; the row-wise path (per-token quantization
# + _scaled_mm) with fast accumulation 99.0 / 99.9 / 99.2 / 99.6 / 112.3 / 163.4 / 619.3 / 2,377 (without: 116.5 /
# 107.4 / 104.0 / 104.6 / 115.9 / 176.2 / 682.9 / 2,759). So from 65 tokens on (up to 64 the tuned blockwise kernel
# wins on gate_up 33.7 vs 35.5 and down 27.0 vs 34.5), except qkv, where it wins from 32 (15.0 vs 16.1 at 32, 15.1
# vs 18.3 at 64).
ROWWISE_MIN_M = 64
ROWWISE_MIN_M_BY_SHAPE: dict[tuple[int, int], int] = {(6144, 4096): 31}  # (N, K): more tokens than this take it
ROWWISE_ENV = "FNVLLM_FP8_ROWWISE"  # "0": fp8_linear never takes the row-wise GEMM (A/B end to end); "1" (default)
ROWWISE_PAD_M = 16  # quantize_per_token pads the tokens to a multiple of this (zero rows) for the GEMM
# torch._scaled_mm's use_fast_accum (Hopper's FP8 MMA accumulating without periodic float32 promotion): 4-14 %
# faster above (times above); relative error against float32 of the same operands 2.1e-3 (3.1e-3 at K = 12,288)
# instead of 1.7e-3, an order below the activations' e4m3 rounding (2.6e-2 against bf16).
ROWWISE_FAST_ACCUM = True
_PER_TOKEN_MAX_TILE = 16384  # columns quantize_per_token holds in registers at once (more: two passes)


def _rowwise_from_env() -> bool:
    """ROWWISE_ENV's value as a switch ("1" or unset: on, "0": off); ValueError naming it otherwise."""
    return env_switch(ROWWISE_ENV, True)


ROWWISE = _rowwise_from_env()


def takes_rowwise(m: int, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` runs M tokens x against a row-group weight w with ``fp8_rowwise_mm``: the switch
    on, M > ``rowwise_min_m`` of w's shape, bf16 activations (torch's row-wise kernel writes bf16 only), N and K
    multiples of 16 (cuBLAS's alignment) and the recipe present on x's GPU."""
    n, k = w.shape
    return (
        ROWWISE
        and m > rowwise_min_m(n, k)
        and x.dtype == torch.bfloat16
        and n % 16 == 0
        and k % 16 == 0
        and _has_rowwise_scaled_mm(x.device.index or 0)
    )


def rowwise_min_m(n: int, k: int) -> int:
    """The most tokens of an (N, K) weight that still take the other paths: its ROWWISE_MIN_M_BY_SHAPE entry, else
    ROWWISE_MIN_M."""
    return ROWWISE_MIN_M_BY_SHAPE.get((n, k), ROWWISE_MIN_M)


@functools.cache
def _has_rowwise_scaled_mm(device_index: int) -> bool:
    """Whether torch._scaled_mm takes row-wise scales (scale_a (M, 1), scale_b (1, N) float32) on this GPU: one
    small product is tried once per device."""
    w = torch.zeros(256, 256, dtype=FP8_DTYPE, device=f"cuda:{device_index}")
    x = torch.zeros(16, 256, dtype=torch.bfloat16, device=w.device)
    return _runs(lambda: fp8_rowwise_mm(x, w, torch.ones(1, 256, device=w.device)))


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    ROUND_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One token (row) per program: scale = max(amax / 448, MIN_SCALE) over its K columns, q = x / scale in e4m3.
    Rows M and up (the padding) read nothing and write zeros. ONE_TILE: the row fits one BLOCK_K tile, held in
    registers; otherwise one pass for the amax and a second (from L2) to quantize. ROUND_FIRST as in
    ``_quantize_activations_kernel``."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    k_read = tl.where(row < M, K, 0)  # columns to read: none in the padding rows
    if ONE_TILE:
        x = tl.load(x_row + offs, mask=offs < k_read, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        _store_e4m3(q_row + offs, x / scale, offs < K, FP8_MAX, ROUND_FIRST)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < k_read, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < k_read, other=0.0).to(tl.float32)
            _store_e4m3(q_row + k0 + offs, x / scale, k0 + offs < K, FP8_MAX, ROUND_FIRST)
    tl.store(s_ptr + row, scale)


@triton.jit
def _store_e4m3(ptrs, v, mask, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Store v (float32, already divided by its scale) clamped to +-448 as e4m3 at ``ptrs`` where ``mask``."""
    q = tl.clamp(v, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        q = _round_to_e4m3(q)
    tl.store(ptrs, q.to(ptrs.dtype.element_ty), mask=mask)


def quantize_per_token(
    x: torch.Tensor, pad_rows: int = 1, block_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel of ``quantize_per_token_ref``: (x_q (M', K) fp8, x_scale (M', 1) float32) with M' = M rounded up
    to a multiple of ``pad_rows`` (the extra rows zeros, their scale MIN_SCALE). One launch, one program per row;
    no host reads of device values (CUDA-graph capturable). block_k: columns per tile (None: the whole row up to
    16,384 columns, else 8,192 per pass; a power of two)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if pad_rows < 1:
        raise ValueError(f"pad_rows must be >= 1, got {pad_rows}")
    m, k = x.shape
    if block_k is None:
        block_k = max(16, triton.next_power_of_2(k))
        block_k = block_k if block_k <= _PER_TOKEN_MAX_TILE else _PER_TOKEN_MAX_TILE // 2
    elif block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    rows = triton.cdiv(m, pad_rows) * pad_rows
    x_q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_per_token_kernel[(rows,)](
            x, x_q, x_scale, m, k, x.stride(0), x_q.stride(0),
            BLOCK_K=block_k, ONE_TILE=block_k >= k, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            ROUND_FIRST=upcast_dot(x.device), USE_PDL=use_pdl(x.device),
            num_warps=min(16, max(4, block_k // 1024)), **pdl_launch(x.device),
        )  # fmt: skip
    return x_q, x_scale


def fp8_rowwise_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    fast_accum: bool | None = None,
) -> torch.Tensor:
    """x (M, K) bf16 @ (w (N, K) e4m3 * row_scale (1, N)).T (+ bias) with torch's row-wise ``_scaled_mm``: the
    activations quantized per token (``quantize_per_token``, M padded to ROWWISE_PAD_M and cut back), one scale per
    weight row. Same numerics as ``fp8_rowwise_ref``. fast_accum: ``_scaled_mm``'s use_fast_accum (None:
    ROWWISE_FAST_ACCUM)."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or w.dtype != FP8_DTYPE:
        raise ValueError(f"x (M, K) and e4m3 w (N, K) must agree on K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if tuple(row_scale.shape) != (1, n) or row_scale.dtype != torch.float32 or not row_scale.is_contiguous():
        raise ValueError(f"row_scale must be contiguous float32 (1, N) = (1, {n}), got {row_scale.dtype} "
                         f"{tuple(row_scale.shape)}")  # fmt: skip
    m = x.shape[0]
    x_q, x_scale = quantize_per_token(x if x.stride(-1) == 1 else x.contiguous(), pad_rows=ROWWISE_PAD_M)
    accum = ROWWISE_FAST_ACCUM if fast_accum is None else fast_accum
    out = torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=row_scale, out_dtype=x.dtype, use_fast_accum=accum)
    out = out[:m]
    return out if bias is None else out.add_(bias)
