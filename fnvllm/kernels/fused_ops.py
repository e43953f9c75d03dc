"""Fused elementwise/row kernels of the decoder layer in Triton, each beside its torch reference.

- `rmsnorm(x, weight, eps)`: one program per row; y = weight * (x / sqrt(mean(x^2) + eps)) with the
  normalisation in float32, cast back to x's dtype before the weight (as `rmsnorm_ref` in model/ops.py).
- `fused_add_rmsnorm(x, residual, weight, eps)`: one pass instead of three: r = x + residual rounded to the
  input dtype (it is the new residual stream), then rmsnorm(r). Matches `add_rmsnorm_ref`. x may be the float32
  split partials a projection left unsummed (`SplitPartials`): the kernel sums them first, in split order.
- `silu_and_mul(x)`: x = [gate | up] (T, 2I) -> silu(gate) * up (T, I), computed in float32, rounded once.
- `rotary(x, cos, sin)`: neox-style rotation of x (T, H, D) by per-token angles, in float32 (as
  `rotary_ref`): with x = [x1 | x2] halves, out = [x1 cos - x2 sin | x2 cos + x1 sin].
- `norm_rotary(x, weight, eps, cos, sin)`: Qwen3's per-head q/k RMSNorm and the rotation in one kernel, reading
  the strided q or k view of the qkv projection directly (unfused: a copy, a norm and a rotation, 3 kernels).
- `rmsnorm_quant`, `fused_add_rmsnorm_quant`, `silu_and_mul_quant`: the same ops writing, instead of their 16-bit
  result y, y quantized for the FP8 weight GEMMs (`Fp8Activations`: e4m3 values and one float32 scale per
  (token, 128 columns), exactly `fp8_gemm.quantize_activations(y)`), so the small-M FP8 GEMM after them needs no
  quantization launch of its own (docs/fp8_weights.md, "Activations quantized by their producer").

Worked example (rmsnorm, eps 0): x = [3, 4] -> mean(x^2) = 12.5, rsqrt = 0.2828 -> [0.8485, 1.1314] * weight.

The references are model/ops.py's, re-exported here. They round where torch does (silu in bf16, then the
product); the kernels round once, so bf16 results may differ by one unit in the last place; float32 results
agree to ~1e-6.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fnvllm.env import env_switch
from fnvllm.kernels.reference import add_rmsnorm_ref as fused_add_rmsnorm_ref
from fnvllm.kernels.reference import norm_rotary_ref, rmsnorm_ref, rotary_ref, silu_and_mul_ref

__all__ = [
    "Fp8Activations",
    "SplitPartials",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "fused_add_rmsnorm_ref",
    "norm_rotary",
    "norm_rotary_ref",
    "rmsnorm",
    "rmsnorm_quant",
    "rmsnorm_ref",
    "rotary",
    "rotary_ref",
    "silu_and_mul",
    "silu_and_mul_quant",
    "silu_and_mul_ref",
    "sum_split_partials",
]


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before it
# finishes (its programs placed and its prologue run), and waits (griddepcontrol.wait) before it reads or writes
# anything an earlier kernel writes: at that point the kernel before it has completed, and, since that one waited
# for its own predecessor before completing, so has every earlier kernel. Each of our kernels lets its dependents
# start (griddepcontrol.launch_dependents) right after that wait, so at most two kernels overlap, except the small
# kernels between two projections (RMSNorm, SiLU-and-mul, the attention prologue) at EARLY_TRIGGER_ROWS rows, which
# let the next kernel start before their own wait (``triggers_first``): that kernel is then placed, and reads its
# weights or first K/V tile (data no kernel of the step writes), while the big kernel before the small one still
# runs. On by default (bit-exact, and ~15 % less device time per decode step at 1 request on the H200:
# BENCHMARKS.md); FNVLLM_PDL=0 turns it off.
PDL_DEFAULT = env_switch("FNVLLM_PDL", True)
_PDL = {"enabled": PDL_DEFAULT}
# Rows (tokens) at which the small kernels let their dependents start before their own wait, measured on the H200
# (BENCHMARKS.md, thirteenth session; Qwen3-0.6B latency bench, device ms per decode step, on against off, two rounds):
# 64 rows 1.476 / 1.476 against 1.495 / 1.494, 32 rows 1.338 / 1.337 against 1.364 / 1.363, 16 rows not better
# (1.125 / 1.083 against 1.072 / 1.086 in an earlier call: not taken), 1 row unchanged; every kernel triggering
# first instead: 64 rows 1.478 but 16 rows 1.193. FNVLLM_EARLY_TRIGGER=0 turns it off (read at import).
EARLY_TRIGGER_ROWS = (17, 64) if env_switch("FNVLLM_EARLY_TRIGGER", True) else (0, 0)


def set_pdl(enabled: bool) -> None:
    """Switch programmatic dependent launch of the decode-step kernels on or off (for launches from now on)."""
    _PDL["enabled"] = enabled


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch (on, CUDA, sm_90+)."""
    return _PDL["enabled"] and device.type == "cuda" and _capability_major(device.index) >= 9


@functools.cache
def _capability_major(index: int | None) -> int:
    """The CUDA device's compute capability major version."""
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def gpu_model(index: int) -> str:
    """``torch.cuda.get_device_name`` of CUDA device ``index``, asked once a device: the key of the launch tables
    kept per GPU model (``cuda_skinny.DEVICE_CONFIGS``, ``decode_attention.DEVICE_SHORT_CONFIGS``), which are
    looked up at every launch."""
    return torch.cuda.get_device_name(index)


def triggers_first(device: torch.device, num_rows: int) -> bool:
    """Whether a small kernel launched under PDL for ``num_rows`` rows lets the next kernel start before its own
    wait (the TRIGGER_FIRST argument of ``wait_for_previous_kernel``): PDL on and the rows in EARLY_TRIGGER_ROWS."""
    lo, hi = EARLY_TRIGGER_ROWS
    return use_pdl(device) and lo <= num_rows <= hi


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch keyword arguments for a kernel with a USE_PDL parameter: ``launch_pdl`` when on (else none)."""
    return {"launch_pdl": True} if use_pdl(device) else {}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr = False):
    """Under programmatic dependent launch: wait until the kernels before this one have completed (their writes
    visible), then let the next kernel start; with TRIGGER_FIRST (``triggers_first``) let it start first, then
    wait. A no-op otherwise. A kernel whose predecessor triggers first may start while kernels before that one
    still run: before its own wait it reads only what no kernel of the step writes (weights, the step's inputs,
    cached K/V of earlier tokens)."""
    if USE_PDL:
        if TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


L2_LINE_BYTES = 128  # the unit ``prefetch.global.L2`` asks for


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the 128-byte line at each pointer of ptrs: no data returned and no value changed, a
    hint that later loads find the lines in L2 (lines no kernel of the step writes: weights). GPU only (inline PTX)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_lines_l2(pf_ptr, n_lines, LANES: tl.constexpr):
    """Ask L2 for this program's share of the n_lines 128-byte lines from pf_ptr (a byte pointer), LANES at a time:
    program p of R takes lines p * L .. (p + 1) * L - 1, L = cdiv(n_lines, R), so each program's requests are one
    contiguous run (``prefetch_l2``), for the loads of a later kernel."""
    per = tl.cdiv(n_lines, tl.num_programs(0))
    first = tl.program_id(0) * per
    end = tl.minimum(first + per, n_lines)
    lanes = tl.arange(0, LANES)
    for start in range(first, end, LANES):
        line = start + lanes
        prefetch_l2(pf_ptr + tl.where(line < end, line, first).to(tl.int64) * 128)  # (masked lanes: the first line)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    pf_ptr,  # PREFETCH: bytes (the next product's weight) to ask L2 for before the wait
    pf_lines,
    eps,
    n_rows,
    n_cols,
    HAS_RESIDUAL: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Normalise row program_id(0) of x (after adding the residual row and storing the sum, if HAS_RESIDUAL).
    NUM_PARTS > 0 (with a residual): x is a GEMM's float32 split partials (NUM_PARTS, n_rows, n_cols), summed in
    split order and rounded to the residual's dtype first (``_row_values``). PREFETCH: before waiting on the
    previous kernel, the programs ask L2 for pf_lines 128-byte lines from pf_ptr between them
    (``prefetch_lines_l2``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no earlier kernel writes it
    if PREFETCH:  # a weight too: its lines stream into L2 while the kernel before this one runs
        prefetch_lines_l2(pf_ptr, pf_lines, BLOCK)
    wait_for_previous_kernel(USE_PDL, TRIGGER_FIRST)
    dtype = res_out_ptr.dtype.element_ty  # x's (res_out is x itself without a residual)
    x = _row_values(x_ptr, res_ptr, row, cols, mask, n_rows, n_cols, HAS_RESIDUAL, NUM_PARTS, dtype)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * inv_rms).to(dtype).to(tl.float32)  # cast back before the weight, as torch
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise x (..., N) over its last dim and scale by weight (N,); returns a new (..., N) tensor."""
    _check_norm_args(x, weight)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (R, N)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    _launch_rmsnorm(rows, None, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor | SplitPartials,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    prefetch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) for x, residual (..., N) in one pass; returns new tensors. x may be a
    projection's output left as split partials (``SplitPartials`` of (S, T, N), residual (T, N)): summed here, in
    split order, into exactly the x that projection would have written. prefetch: a contiguous tensor on x's
    device (the weight of the product after the norm) whose bytes the kernel asks L2 for before it waits on the
    previous kernel, under programmatic dependent launch only (``use_pdl``; elsewhere ignored): a hint, no value
    changes."""
    shape, dtype, device = _value_meta(x)
    if tuple(residual.shape) != shape or residual.dtype != dtype or residual.device != device:
        raise ValueError(
            f"residual must match x ({shape} {dtype} on {device}), got {tuple(residual.shape)} "
            f"{residual.dtype} on {residual.device}"
        )
    _check_norm_args(residual, weight)
    res_rows = residual.reshape(-1, shape[-1]).contiguous()  # (R, N)
    rows = x.parts.contiguous() if isinstance(x, SplitPartials) else x.reshape(-1, shape[-1]).contiguous()
    new_residual = torch.empty_like(res_rows)
    out = torch.empty(res_rows.shape, dtype=torch.result_type(weight, residual), device=device)
    _launch_rmsnorm(rows, res_rows, new_residual, weight, out, eps, prefetch)
    return out.view(shape), new_residual.view(shape)


def sum_split_partials(x: SplitPartials) -> torch.Tensor:
    """The (M, N) output split partials x (S, M, N) stand for: summed in split order, rounded to x.dtype, by
    ``_sum_splits_kernel`` (so the rounding is the kernels', also under the interpreter); for the consumers that
    take no partials. Its reference: ``reference.split_partials_sum_ref``."""
    parts = x.parts.contiguous()
    split, num_rows, out_features = parts.shape
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=parts.device)
    if out.numel():
        block = 256
        _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](
            parts, out, out, num_rows, out_features, out.stride(0), HAS_BIAS=False, SPLIT=split, BLOCK=block
        )
    return out


@triton.jit
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    """out[m, n] = sum over s of part[s, m, n] (+ bias[n]), summed in split order; one program per BLOCK outputs."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_rmsnorm(
    rows: torch.Tensor,
    res_rows: torch.Tensor | None,
    res_out: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    prefetch: torch.Tensor | None = None,
) -> None:
    """One program per row of out (R, N); rows is x (R, N), or with a residual its float32 split partials
    (S, R, N); the residual pair is used when given; prefetch: as ``fused_add_rmsnorm``'s."""
    num_rows, n_cols = out.shape
    parts = rows.shape[0] if rows.dim() == 3 else 0
    if parts and res_rows is None:
        raise ValueError("split partials are summed only into a residual add (fused_add_rmsnorm)")
    if prefetch is not None and (prefetch.device != out.device or not prefetch.is_contiguous()):
        raise ValueError(f"prefetch must be a contiguous tensor on {out.device}, got one on {prefetch.device} "
                         f"with strides {prefetch.stride()}")  # fmt: skip
    if num_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    pf = prefetch.reshape(-1).view(torch.uint8) if prefetch is not None and use_pdl(out.device) else None
    _rmsnorm_kernel[(num_rows,)](
        rows,
        res_rows if res_rows is not None else rows,
        res_out if res_out is not None else rows,
        weight,
        out,
        pf if pf is not None else out,
        pf.numel() // L2_LINE_BYTES if pf is not None else 0,
        eps,
        num_rows,
        n_cols,
        HAS_RESIDUAL=res_rows is not None,
        NUM_PARTS=parts,
        BLOCK=block,
        USE_PDL=use_pdl(out.device),
        TRIGGER_FIRST=triggers_first(out.device, num_rows),
        PREFETCH=pf is not None,
        num_warps=_row_warps(block),
        **pdl_launch(out.device),
    )


def _row_warps(block: int) -> int:
    """Warps for a row of `block` elements: ~8 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError unless weight is (N,) for x (..., N), both floating and on one device."""
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must be ({x.shape[-1] if x.dim() else '?'},) for x {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point) or x.device != weight.device:
        raise ValueError(
            f"x and weight must be floating and on one device, got {x.dtype} on {x.device}, "
            f"{weight.dtype} on {weight.device}"
        )
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr
):
    """out[t, j] = silu(x[t, j]) * x[t, n_cols + j] for the column block program_id(1) of row program_id(0)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    wait_for_previous_kernel(USE_PDL, TRIGGER_FIRST)
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] (T, 2I) (rows may be strided); returns a new (T, I) tensor."""
    if x.dim() != 2 or x.shape[1] % 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating (T, 2I) tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dim")
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)  # (T, I)
    if num_rows == 0 or n_cols == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        x,
        out,
        x.stride(0),
        n_cols,
        BLOCK=block,
        USE_PDL=use_pdl(x.device),
        TRIGGER_FIRST=triggers_first(out.device, num_rows),
        num_warps=_row_warps(block),
        **pdl_launch(x.device),
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    eps,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rotate all heads of token program_id(0): [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin], in float32;
    with HAS_NORM, RMS-normalise each head by w first (rounded where torch rounds: after the normalisation and
    after the weight)."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    mask = (h < num_heads)[:, None]
    x_offs = tok * stride_xt + h[:, None] * stride_xh + j[None, :]  # (BLOCK_H, HALF)
    dtype = out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + tok * stride_ct + j)[None, :].to(tl.float32)  # (1, HALF)
    sin = tl.load(sin_ptr + tok * stride_st + j)[None, :].to(tl.float32)
    y1, y2 = norm_rope_heads(x_ptr + x_offs, mask, w_ptr, cos, sin, eps, HALF, HAS_NORM, dtype)
    o_offs = tok * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(out_ptr + o_offs, y1.to(dtype), mask=mask)
    tl.store(out_ptr + o_offs + HALF, y2.to(dtype), mask=mask)


@triton.jit
def norm_rope_heads(
    x_ptrs, mask, w_ptr, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr
):
    """The rotated halves (H, HALF) float32 of the heads at x_ptrs (H, HALF) (first halves; the second halves sit
    HALF elements on), RMS-normalised per head by w first when HAS_NORM (rounded to dtype where torch rounds:
    after the normalisation and after the weight); cos / sin (1, HALF) float32. Rows where mask is False are 0.
    """
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        j = tl.arange(0, HALF)
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # (H,)
        w1 = tl.load(w_ptr + j)[None, :].to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j)[None, :].to(tl.float32)
        x1 = (w1 * (x1 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Neox-style rotary embedding of x (T, H, D) by cos/sin (T, D/2); returns (T, H, D) in x's dtype.

    x may be a strided view (e.g. q or k of a fused qkv projection) with a contiguous last dim; `out` may be x
    itself (each program reads its token before writing it).
    """
    return _launch_rotary(x, None, 0.0, cos, sin, out)


def norm_rotary(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """rotary(rmsnorm(x, weight, eps), cos, sin) per head of x (T, H, D) in one kernel (Qwen3's q/k norm before
    rope); plain rotary when weight is None. x may be a strided view of a fused qkv projection: no copy is made.
    Matches `norm_rotary_ref`."""
    if weight is not None:
        _check_norm_args(x, weight)
    return _launch_rotary(x, weight, eps, cos, sin, None)


def _launch_rotary(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """One program per token of x (T, H, D): optional per-head RMSNorm by weight, then the rotation."""
    _check_rotary_args(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} with a contiguous last dim")
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return out
    _rotary_kernel[(num_tokens,)](
        x,
        weight if weight is not None else cos,
        cos,
        sin,
        out,
        eps,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        HAS_NORM=weight is not None,
        num_warps=_row_warps(triton.next_power_of_2(num_heads) * head_dim),
    )
    return out


def _check_rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ValueError unless x is (T, H, D) with D a power of two >= 2 and cos/sin are (T, D/2) float32."""
    if x.dim() != 3 or x.shape[2] < 2 or x.shape[2] & (x.shape[2] - 1) or x.stride(2) != 1:
        raise ValueError(f"x must be (T, H, D) with D a power of two and a contiguous last dim, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[2] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != torch.float32 or t.stride(1) != 1 or t.device != x.device:
            raise ValueError(
                f"{name} must be {want} float32 on {x.device} with a contiguous last dim, got "
                f"{tuple(t.shape)} {t.dtype}"
            )


# ---- producers of FP8 activations --------------------------------------------------------------------------------

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0  # the largest e4m3 value
_QUANT_GROUP = 128  # columns per activation scale (the weights' 128 x 128 scale blocks: one K block)


class Fp8Activations(NamedTuple):
    """Activations already quantized for the FP8 weight GEMMs (``fp8_gemm.fp8_linear`` takes them in place of x).

    x_q: (M, K) float8_e4m3fn; x_scale: (M, ceil(K / 128)) float32, one scale per (token, 128 columns), so that
    the activations are x_q[m, k] * x_scale[m, k // 128]; dtype: the 16-bit dtype of the unquantized values (the
    GEMM's output dtype). Exactly ``fp8_gemm.quantize_activations`` of those values."""

    x_q: torch.Tensor
    x_scale: torch.Tensor
    dtype: torch.dtype


class SplitPartials(NamedTuple):
    """A GEMM's output left as the float32 partial products of its K splits, for the next kernel to sum
    (``fp8_gemm.fp8_gemm_swap_partials``): parts (S, M, N) float32, summed in split order (from 0) and rounded to
    dtype, the output's 16-bit dtype, gives exactly the GEMM's (M, N) output."""

    parts: torch.Tensor
    dtype: torch.dtype


@triton.jit
def round_to_e4m3(v):
    """v rounded (half away from zero) to the e4m3 grid: 3 mantissa bits, subnormal step 2**-9 (for the
    interpreter, whose float32 -> e4m3 conversion drops the carry of a rounding that crosses a power of two)."""
    exponent = tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625)))  # 2**-6: the smallest normal
    step = tl.exp2(exponent - 3.0)
    return tl.where(v < 0, -1.0, 1.0) * tl.floor(tl.abs(v) / step + 0.5) * step


INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # 1 / the largest e4m3 value; a float32 0x3B124925 in the kernels


@triton.jit
def quantize_groups(x, ROUND_FIRST: tl.constexpr):
    """(q, scale) for x (G, 128) float32, one scale per row of 128 columns: scale = max(amax / 448, 1e-12), q =
    clamp(x / scale, -448, 448), still float32 (ROUND_FIRST: rounded to the e4m3 grid first, the interpreter's fix,
    so the caller's conversion to e4m3 is exact). The one definition of the activation quantization: the producers
    here and ``fp8_gemm``'s quantization kernels all call it, so their e4m3 bytes agree bit for bit (and
    ``cuda_fp8_skinny``'s in-kernel quantization repeats it). amax / 448 is written as a product with the float32
    constant 1 / 448: a division by a constant is lowered differently across Triton versions (3.9 multiplies by
    an approximate reciprocal), a product is the same bits everywhere."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * INV_FP8_MAX, 1e-12)
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    if ROUND_FIRST:
        q = round_to_e4m3(q)
    return q, scale


@triton.jit
def store_fp8_groups(y, cols, n_cols, q_row, s_row, first_group, GROUPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Quantize y (GROUPS, 128) float32, one token's columns ``cols`` (GROUPS, 128) (first_group * 128 on), as
    ``fp8_gemm.quantize_activations`` does (``quantize_groups``); store q at q_row + cols (< n_cols) and the scales
    at s_row + group (groups past the row's last are not stored). Columns past n_cols must hold 0 in y (as the
    unfused kernel's masked load gives)."""
    q, scale = quantize_groups(y, ROUND_FIRST)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cols < n_cols)
    groups = first_group + tl.arange(0, GROUPS)
    tl.store(s_row + groups, scale, mask=groups * 128 < n_cols)


@triton.jit
def _group_cols(first, GROUPS: tl.constexpr):
    """Columns (GROUPS, 128) of GROUPS 128-column groups from column ``first`` on."""
    return first + tl.arange(0, GROUPS)[:, None] * 128 + tl.arange(0, 128)[None, :]


@triton.jit
def _row_values(x_ptr, res_ptr, row, offs, mask, n_rows, n_cols, HAS_RESIDUAL: tl.constexpr,
                NUM_PARTS: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """Row ``row`` of x at columns offs (any shape; 0 where not mask) in dtype, plus the residual row rounded like
    torch's add when HAS_RESIDUAL. NUM_PARTS > 0: x_ptr holds (NUM_PARTS, n_rows, n_cols) float32 split partials,
    summed in split order from 0 and rounded to dtype (as ``fp8_gemm._sum_splits`` writes a GEMM's output)."""
    if NUM_PARTS > 0:
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(NUM_PARTS):
            acc += tl.load(x_ptr + (s * n_rows + row) * n_cols + offs, mask=mask, other=0.0)
        x = acc.to(dtype)
    else:
        x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded like torch's add
    return x


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, res_ptr, res_out_ptr, w_ptr, q_ptr, s_ptr, eps, n_rows, n_cols, n_groups,
    HAS_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """``_rmsnorm_kernel``'s row (the same arithmetic, to its 16-bit output y), then y quantized per 128 columns
    into q / s (``store_fp8_groups``) instead of stored. The row's sum of squares is taken over the 1-D (BLOCK,)
    row exactly as ``_rmsnorm_kernel`` takes it (same layout, same order); the elementwise rest is done on the row
    read again (L1 / L2) as (group, 128) tiles, the layout the per-group quantization wants. (A reshape of the 1-D
    row instead took 5.9 us against the unfused kernel's 1.2 at 4,096 columns on the H200: under Triton 3.6 it
    staged the e4m3 bytes through shared memory and stored them a byte per instruction.) NUM_PARTS > 0: x is
    split partials (``_row_values``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    cols2 = _group_cols(0, BLOCK // 128)  # (groups, 128)
    mask2 = cols2 < n_cols
    dtype = res_out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols2, mask=mask2, other=0.0).to(tl.float32)  # a weight: no earlier kernel writes it
    wait_for_previous_kernel(USE_PDL)
    x = _row_values(x_ptr, res_ptr, row, cols, mask, n_rows, n_cols, HAS_RESIDUAL, NUM_PARTS, dtype)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    x2 = _row_values(x_ptr, res_ptr, row, cols2, mask2, n_rows, n_cols, HAS_RESIDUAL, NUM_PARTS, dtype)
    normed = (x2.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)  # cast back before the weight, as torch
    y = (w * normed).to(dtype).to(tl.float32)  # what rmsnorm stores (weight and x: one dtype)
    store_fp8_groups(y, cols2, n_cols, q_ptr + row * n_cols, s_ptr + row * n_groups, 0, BLOCK // 128, ROUND_FIRST)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activations:
    """``rmsnorm(x, weight, eps)`` of x (T, N) quantized for the FP8 GEMMs in the same launch (``Fp8Activations``,
    exactly ``quantize_activations(rmsnorm(x, weight, eps))``); weight in x's 16-bit dtype."""
    return _launch_norm_quant(x, None, weight, eps)[0]


def fused_add_rmsnorm_quant(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activations, torch.Tensor]:
    """(``rmsnorm_quant(x + residual)``, x + residual) for x, residual (T, N) in one launch: ``fused_add_rmsnorm``
    with its normalised output quantized (``Fp8Activations``) instead of written; returns new tensors. x may be a
    GEMM's output left as split partials (``SplitPartials`` of (S, T, N)): summed here, in split order, into
    exactly the x that GEMM would have written."""
    shape, dtype, device = _value_meta(x)
    if tuple(residual.shape) != shape or residual.dtype != dtype or residual.device != device:
        raise ValueError(
            f"residual must match x ({shape} {dtype} on {device}), got {tuple(residual.shape)} "
            f"{residual.dtype} on {residual.device}"
        )
    acts, new_residual = _launch_norm_quant(x, residual, weight, eps)
    if new_residual is None:  # pragma: no cover - made whenever a residual is given
        raise RuntimeError("fused_add_rmsnorm_quant lost its residual")
    return acts, new_residual


def _check_quant_input(x: torch.Tensor) -> None:
    """ValueError unless x is a 2-D bf16/fp16 tensor (the FP8 GEMMs' activation dtypes)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a 2-D bfloat16 or float16 tensor, got {tuple(x.shape)} {x.dtype}")


def _value_meta(x: torch.Tensor | SplitPartials) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    """(shape, dtype, device) of the (T, N) value x stands for (split partials: their sum's)."""
    if isinstance(x, SplitPartials):
        if x.parts.dim() != 3 or x.parts.dtype != torch.float32:
            got = f"{tuple(x.parts.shape)} {x.parts.dtype}"
            raise ValueError(f"SplitPartials.parts must be float32 (S, T, N), got {got}")
        return tuple(x.parts.shape[1:]), x.dtype, x.parts.device
    return tuple(x.shape), x.dtype, x.device


def _launch_norm_quant(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activations, torch.Tensor | None]:
    """(the normalised x (+ residual) quantized, the new residual or None): one program per row, with the block
    and warps of ``_launch_rmsnorm`` (so the row's sum is reduced in the same order)."""
    parts = x.parts.contiguous() if isinstance(x, SplitPartials) else None
    shape, dtype, device = _value_meta(x)
    rows = torch.empty(shape, dtype=dtype, device=device) if parts is not None else x.contiguous()  # (T, N)
    _check_norm_args(rows, weight)
    _check_quant_input(rows)
    if weight.dtype != dtype:
        raise ValueError(f"weight must be x's dtype {dtype} (the quantized output stands for it), got {weight.dtype}")
    num_rows, n_cols = rows.shape
    n_groups = triton.cdiv(n_cols, _QUANT_GROUP)
    x_q = torch.empty(rows.shape, dtype=_E4M3, device=device)
    x_scale = torch.empty((num_rows, n_groups), dtype=torch.float32, device=device)
    res_rows = None if residual is None else residual.contiguous()
    new_residual = None if res_rows is None else torch.empty_like(rows)
    if num_rows:
        block = max(_QUANT_GROUP, triton.next_power_of_2(n_cols))
        _rmsnorm_quant_kernel[(num_rows,)](
            rows if parts is None else parts, rows if res_rows is None else res_rows,
            rows if new_residual is None else new_residual, weight, x_q, x_scale, eps, num_rows, n_cols, n_groups,
            HAS_RESIDUAL=res_rows is not None, NUM_PARTS=0 if parts is None else parts.shape[0], BLOCK=block,
            ROUND_FIRST=device.type != "cuda", USE_PDL=use_pdl(device),
            num_warps=_row_warps(triton.next_power_of_2(n_cols)), **pdl_launch(device),
        )  # fmt: skip
    return Fp8Activations(x_q, x_scale, dtype), new_residual


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_xt, n_cols, n_groups,
    BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``_silu_and_mul_kernel``'s column block program_id(1) of row program_id(0) (BLOCK a multiple of 128), in
    (group, 128) tiles (elementwise, so the same values), its 16-bit result quantized per 128 columns into q / s
    (``store_fp8_groups``) instead of stored."""
    row = tl.program_id(0).to(tl.int64)
    cols = _group_cols(tl.program_id(1) * BLOCK, BLOCK // 128)  # (groups, 128)
    mask = cols < n_cols
    wait_for_previous_kernel(USE_PDL)
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)  # what silu_and_mul stores
    first_group = tl.program_id(1) * (BLOCK // 128)
    q_row, s_row = q_ptr + row * n_cols, s_ptr + row * n_groups
    store_fp8_groups(y, cols, n_cols, q_row, s_row, first_group, BLOCK // 128, ROUND_FIRST)


def silu_and_mul_quant(x: torch.Tensor) -> Fp8Activations:
    """``silu_and_mul(x)`` for x = [gate | up] (T, 2I) (rows may be strided) quantized for the FP8 GEMMs in the
    same launch (``Fp8Activations`` of (T, I), exactly ``quantize_activations(silu_and_mul(x))``)."""
    _check_quant_input(x)
    if x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be (T, 2I) with a contiguous last dim, got {tuple(x.shape)} strides {x.stride()}")
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    n_groups = triton.cdiv(n_cols, _QUANT_GROUP)
    x_q = torch.empty((num_rows, n_cols), dtype=_E4M3, device=x.device)  # (T, I)
    x_scale = torch.empty((num_rows, n_groups), dtype=torch.float32, device=x.device)
    if num_rows and n_cols:
        block = max(_QUANT_GROUP, min(1024, triton.next_power_of_2(n_cols)))
        _silu_and_mul_quant_kernel[(num_rows, triton.cdiv(n_cols, block))](
            x, x_q, x_scale, x.stride(0), n_cols, n_groups,
            BLOCK=block, ROUND_FIRST=x.device.type != "cuda", USE_PDL=use_pdl(x.device),
            num_warps=_row_warps(block), **pdl_launch(x.device),
        )  # fmt: skip
    return Fp8Activations(x_q, x_scale, x.dtype)
