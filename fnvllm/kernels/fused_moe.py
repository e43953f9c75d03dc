"""The routed experts of a mixture-of-experts layer in Triton, beside the torch reference (``fused_moe_ref``).

Each of T tokens picks K experts. Done expert by expert (the reference) that is a loop of 2E small GEMMs with
a host round trip per expert; here it is four steps, none of which syncs with the host (CUDA-graph safe):

1. ``align_by_expert`` (``moe_align.py``; two or three Triton launches, one program per chunk of assignments): the
   T*K assignments (flat index a = t*K + k) sorted by expert, each expert's group padded to a multiple of
   BLOCK_M, so that every block of BLOCK_M sorted slots belongs to one expert; padding slots are masked. The slot
   count is bounded without reading the routing, so the grid is fixed for a given T.
2. ``_gate_up_kernel``: per (block of slots, block of I): gather the tokens' rows of x, multiply by the block's
   expert's gate and up rows (two accumulators), and store silu(gate) * up in slot order: (slots, I).
3. ``_down_kernel``: per (block of slots, block of H): the block's (contiguous) activation rows times the
   expert's down projection, scaled by the assignment's routing weight, stored per assignment: (T*K, H).
4. ``_combine_kernel``: the K rows of each token (contiguous: assignment order) summed in float32 in k order
   (deterministic, unlike atomic adds into the output from the down kernel, and blind to the slot order).

Block sizes are picked by the mean number of assignments per expert (``pick_config``): few (decode) -> small
BLOCK_M, every expert's weights streamed once (bandwidth); many (prefill) -> large tiles (compute). Within a
block of slots the weight tiles are walked along N with the slot blocks grouped (GROUP_M), so programs that run
together read the same expert's tiles. With ``tma`` the weight tiles (and the down kernel's activation tiles)
are loaded through TMA tensor descriptors; the down kernel's tiles may differ from the gate_up kernel's
(``down_block_n`` ...), as its K (the intermediate size) is short.

FP8 experts (``fused_moe(..., w_gate_up_scale=, w_down_scale=)``: e4m3 weights with one float32 scale per 128 x 128
block, ``fnvllm.model.quant``'s layout, from official checkpoints or quantized at load in 128-row groups): weight-only
FP8. The activations stay in the model dtype and each weight tile is dequantized in registers right after its load
(``_dequantize``: e4m3 -> float32, times its row block's scale for the tile's K block, rounded once to the activation
dtype, as ``dequantize_fp8_blocks`` rounds), then the same 16-bit dot. A decode step reads half the expert bytes of
bf16; the products stay on the 16-bit tensor cores. One scale column serves a tile because every K tile lies in one
128-column block (BLOCK_K divides 128; all shipped configs); the N tile may span several row blocks (a scale per
weight row). Pointer, TMA (the e4m3 tiles through descriptors), fused gate/up, persistent and atomic variants all
take it. No activation quantization: there is no fp8 x fp8 path here (it would pay at prefill, not at decode).

Float32 inputs multiply in IEEE float32 (no TF32), so float32 models match Hugging Face's; 16-bit inputs
accumulate in float32 and round once per stored tensor. Products go through decode_attention's ``dot``, which
widens 16-bit operands under the CPU interpreter only (whose bf16 dot is wrong).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from fnvllm.kernels.decode_attention import dot, dot_precision, upcast_dot
from fnvllm.kernels.fused_ops import pdl_launch, use_pdl, wait_for_previous_kernel
from fnvllm.kernels.moe_align import (
    ALIGN_PROGRAMS,
    AlignPlan,
    ExpertAlignment,
    align_by_expert,
    align_by_expert_ref,
    align_plan,
    max_slots,
)
from fnvllm.kernels.reference import FP8_DTYPE, SCALE_BLOCK, fused_moe_ref

_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)  # rows and columns of one FP8 weight scale block

__all__ = [
    "AlignPlan",
    "ExpertAlignment",
    "MoeKernelConfig",
    "align_by_expert",
    "align_by_expert_ref",
    "align_plan",
    "combine",
    "fused_moe",
    "fused_moe_ref",
    "max_slots",
    "moe_down",
    "moe_gate_up",
    "pick_config",
]


@attrs.frozen
class MoeKernelConfig:
    """Tile sizes and launch shape of both grouped GEMMs (BLOCK_* >= 16: tl.dot's minimum).

    block_n is the gate_up kernel's N tile, which it holds twice (a gate and an up accumulator); the down kernel,
    with one accumulator, uses ``down_block_n`` (None: 2 * block_n, the same number of accumulator registers) and
    ``down_block_k`` (None: block_k; its K, the intermediate size, is short: 768 for Qwen3-30B-A3B), and
    ``down_num_warps`` / ``down_num_stages`` (None: the gate_up kernel's).
    atomic_combine: the down kernel adds its weighted rows straight into a float32 (T, H) sum with atomics
        (then one cast) instead of storing (T*K, H) for the combine kernel: fewer bytes, but the order of the
        K additions, hence the last bits, varies from run to run (benchmark variant; off in the shipped configs).
    persistent: launch ``programs_per_sm`` programs per SM that walk the used tiles, so the next tile's loads
        overlap this one's epilogue (``tl.range(flatten=True)``), instead of one per tile.
    down_persistent: the down kernel's own ``persistent`` (None: the gate_up kernel's); its K is short (12 steps
        of 64 at Qwen3-30B-A3B), so overlapping the epilogue pays there first.
    tma: load the weight tiles (and the down kernel's activation tiles, contiguous in slot order) through TMA
    tensor descriptors instead of pointer arithmetic (sm90+; used only where every row stride is 16-byte aligned,
    else the pointer path runs).
    fused_gate_up: with ``tma``, load each gate tile and its up tile in one 4-D TMA box and multiply them as one
        (BLOCK_K, 2 * BLOCK_N) operand (one dot per K step instead of two: the x tile is read from shared memory
        once), the accumulator split into gate and up after the loop.
    align_programs / align_scan: at most this many programs per alignment launch (``moe_align.align_plan``), and
        whether a scan launch sums the chunks' counts (None: above ``moe_align.SCAN_ABOVE`` chunks).
    combine_block / combine_warps: the combine kernel's columns per program and warps.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    down_block_n: int | None = None
    down_block_k: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None
    atomic_combine: bool = False
    persistent: bool = False
    down_persistent: bool | None = None
    fused_gate_up: bool = False
    align_programs: int = ALIGN_PROGRAMS
    align_scan: bool | None = None
    combine_block: int = 1024
    combine_warps: int = 4
    programs_per_sm: int = 1

    def __attrs_post_init__(self) -> None:
        """Reject alignment and combine settings no launch could use (the tiles are checked by the compiler)."""
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.align_programs < 1:
            raise ValueError(f"align_programs must be >= 1, got {self.align_programs}")
        if self.combine_block < 16 or self.combine_block & (self.combine_block - 1):
            raise ValueError(f"combine_block must be a power of two >= 16, got {self.combine_block}")
        if self.combine_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"combine_warps must be one of 1, 2, 4, 8, 16, got {self.combine_warps}")

    @property
    def down_n(self) -> int:
        """The down kernel's N tile."""
        return self.down_block_n or 2 * self.block_n

    @property
    def down_k(self) -> int:
        """The down kernel's K tile."""
        return self.down_block_k or self.block_k

    @property
    def down_is_persistent(self) -> bool:
        """Whether the down kernel runs persistent programs."""
        return self.persistent if self.down_persistent is None else self.down_persistent


# By mean assignments per expert (T*K / E). Qwen3-30B-A3B (E 128, top-8): a 1-16 token decode step has <= 1 per
# expert, a 256-token one 16 (at most ~30 on one expert, one BLOCK_M of 32: each expert's weights are read once),
# an 8192-token prefill 512 (compute-bound: 128 x 128 tiles, counting both accumulators).
SMALL_CONFIG = MoeKernelConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
DECODE_CONFIG = MoeKernelConfig(block_m=32, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=5)
MEDIUM_CONFIG = MoeKernelConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
# Prefill: the H200 sweep's best at 8,192 tokens (GPU call 2, 23:46: 1,191.8 us = 518.9 TFLOP/s against 1,288.8 us
# for the gate_up of call 1 with a persistent down, and 1,437.8 us before the new alignment): the fused gate_up
# (725.8 us = 568 TFLOP/s), a persistent down (395.5 us), 1,024 alignment chunks with the scan launch (24.7 us) and
# a 2,048-column combine (79.6 us). TMA only where _tma_ok allows, else the pointer path.
PREFILL_CONFIG = MoeKernelConfig(
    block_m=128,
    block_n=128,
    block_k=64,
    group_m=8,
    num_warps=8,
    num_stages=4,
    tma=True,
    down_block_n=256,
    down_block_k=64,
    down_num_warps=8,
    down_num_stages=3,
    down_persistent=True,
    fused_gate_up=True,
    align_programs=1024,
    align_scan=True,
    combine_block=2048,
    combine_warps=4,
)


def pick_config(num_tokens: int, num_experts: int, top_k: int) -> MoeKernelConfig:
    """The tile config for a step of ``num_tokens`` tokens, by mean assignments per expert."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 4:
        return SMALL_CONFIG
    if per_expert <= 24:
        return DECODE_CONFIG
    if per_expert <= 96:
        return MEDIUM_CONFIG
    return PREFILL_CONFIG


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(block of slots, block of N) of program ``pid``, slot blocks grouped by GROUP_M (L2 reuse)."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _rows(a_ptrs, valid, offs_k, k_left, EVEN_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of gathered token rows at ``a_ptrs``; zero for padding slots and, unless
    EVEN_K, past the last ``k_left`` columns. EVEN_K: no mask along K, the contiguous dim, so the loads vectorize
    and the pipeliner can stage them."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=valid[:, None], other=0.0)
    return tl.load(a_ptrs, mask=valid[:, None] & (offs_k < k_left)[None, :], other=0.0)


@triton.jit
def _dequantize(w, s_expert, rows, rows_ok, k0, stride_sn, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """The real weights of the e4m3 tile w (BLOCK_K, N), whose columns are the expert's weight rows ``rows`` (N,)
    and whose K range starts at k0, in DTYPE (the activations' dtype): w times the block scale
    s_expert[row // 128, k0 // 128] of each row, in float32, then rounded once to nearest (as
    ``dequantize_fp8_blocks``). One scale column serves the whole tile because BLOCK_K divides 128
    (``_check_fp8_tiles``); rows not ``rows_ok`` get scale 0 (their columns are masked anyway)."""
    scale = tl.load(s_expert + (rows // _SCALE_BLOCK) * stride_sn + k0 // _SCALE_BLOCK, mask=rows_ok, other=0.0)
    return _round_to(w.to(tl.float32) * scale[None, :], DTYPE, UPCAST)


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """float32 v in DTYPE, rounded to nearest even. The CPU interpreter (UPCAST) truncates float32 -> bfloat16
    (triton 3.9), so there the bits are rounded first (add 0x7FFF plus the kept lowest bit, clear the low 16) and
    the conversion is then exact."""
    if UPCAST:  # noqa: SIM102 (a constexpr test alone, so the GPU compile never sees the dtype test)
        if DTYPE == tl.bfloat16:  # noqa: SIM300
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
            v = bits.to(tl.float32, bitcast=True)
    return v.to(DTYPE)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_slots_ptr,
    num_assignments,
    num_m,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    FUSED: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[slot, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for the slots of one block and N tile (rows in
    slot order; padding slots are not written). TMA: the weight tiles come from ``w_desc`` over (E * 2I, H);
    FUSED (with TMA): ``w_desc`` is over (E, 2, I, H), one load brings a gate and an up tile, and one dot of N
    2*BLOCK_N makes both accumulators (split apart after the loop).
    PERSISTENT: each program walks the used tiles with a stride of the grid size (the next tile's loads overlap
    this one's epilogue); else one tile per program, programs past the used slot blocks exit at once."""
    wait_for_previous_kernel(USE_PDL)
    num_n = tl.cdiv(inter, BLOCK_N)
    if PERSISTENT:
        used_m = tl.load(num_slots_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), used_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile(tile, used_m, num_n, GROUP_M)
            _gate_up_tile(
                x_ptr, w_ptr, w_desc, s_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, pid_m, pid_n,
                num_assignments, hidden, inter, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_out, TOP_K,
                PRECISION, UPCAST, TMA, FUSED, EVEN_K, FP8, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_m, num_n, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_slots_ptr):
            return
        _gate_up_tile(
            x_ptr, w_ptr, w_desc, s_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, pid_m, pid_n, num_assignments,
            hidden, inter, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_out, TOP_K, PRECISION, UPCAST,
            TMA, FUSED, EVEN_K, FP8, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _gate_up_tile(
    x_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    pid_m,
    pid_n,
    num_assignments,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    FUSED: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (slot block, N tile) of ``_gate_up_kernel``. FP8: the e4m3 weight tiles are dequantized in registers
    (``_dequantize``) by the block scales ``s_ptr`` (E, ceil(2I / 128), ceil(H / 128)) of their rows."""
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + slots)
    valid = ids < num_assignments
    tokens = (ids // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
    u_ptrs = g_ptrs + inter * stride_wn
    g_row = (expert * 2 * inter).to(tl.int32) + pid_n * BLOCK_N  # TMA: the gate tile's first row in (E * 2I, H)
    s_expert = s_ptr + expert * stride_se  # FP8: this expert's block scales
    dtype = x_ptr.dtype.element_ty
    if FUSED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # gate columns, then up columns
        pair = tl.arange(0, 2 * BLOCK_N)  # FP8: column c of the pair is row (c // BLOCK_N) * I + n of the expert
        pair_n = pid_n * BLOCK_N + pair % BLOCK_N
        pair_rows = (pair // BLOCK_N) * inter + pair_n
        for k in range(0, tl.cdiv(hidden, BLOCK_K)):
            a = _rows(a_ptrs, valid, offs_k, hidden - k * BLOCK_K, EVEN_K)
            w = w_desc.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, k * BLOCK_K])  # (1, 2, BLOCK_N, BLOCK_K)
            w = tl.trans(tl.reshape(w, (2 * BLOCK_N, BLOCK_K)))  # (BLOCK_K, 2 * BLOCK_N)
            if FP8:
                w = _dequantize(w, s_expert, pair_rows, pair_n < inter, k * BLOCK_K, stride_sn, dtype, UPCAST)
            acc += dot(a, w, PRECISION, UPCAST)
            a_ptrs += BLOCK_K
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BLOCK_K)):
            a = _rows(a_ptrs, valid, offs_k, hidden - k * BLOCK_K, EVEN_K)
            if TMA:  # (BLOCK_N, BLOCK_K) tiles, zero past H; rows past this expert's gate/up only feed masked columns
                g = tl.trans(w_desc.load([g_row, k * BLOCK_K]))
                u = tl.trans(w_desc.load([g_row + inter, k * BLOCK_K]))
            elif EVEN_K:
                g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < hidden - k * BLOCK_K
                g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                g = _dequantize(g, s_expert, offs_n, n_ok, k * BLOCK_K, stride_sn, dtype, UPCAST)
                u = _dequantize(u, s_expert, inter + offs_n, n_ok, k * BLOCK_K, stride_sn, dtype, UPCAST)
            acc_g += dot(a, g, PRECISION, UPCAST)
            acc_u += dot(a, u, PRECISION, UPCAST)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    act_desc,
    w_ptr,
    w_desc,
    s_ptr,
    weights_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_slots_ptr,
    num_assignments,
    num_m,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    ATOMIC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[a, n] = weight[a] * (act[slot] . down_e[n]) for the slots of one block and H tile, a the slot's
    assignment (ATOMIC: out[a // TOP_K, n] += that, in float32). The block's act rows are contiguous (slot order);
    padding rows hold garbage that only reaches their own, unstored, output rows. TMA: act tiles from
    ``act_desc``, weight tiles from ``w_desc`` (E * H, I). PERSISTENT: as in ``_gate_up_kernel``."""
    wait_for_previous_kernel(USE_PDL)
    num_n = tl.cdiv(hidden, BLOCK_N)
    if PERSISTENT:
        used_m = tl.load(num_slots_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), used_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile(tile, used_m, num_n, GROUP_M)
            _down_tile(
                act_ptr, act_desc, w_ptr, w_desc, s_ptr, weights_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr,
                pid_m, pid_n, num_assignments, hidden, inter, stride_act, stride_we, stride_wn, stride_se, stride_sn,
                stride_out, TOP_K, PRECISION, UPCAST, TMA, EVEN_K, FP8, ATOMIC, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_m, num_n, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_slots_ptr):
            return
        _down_tile(
            act_ptr, act_desc, w_ptr, w_desc, s_ptr, weights_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, pid_m,
            pid_n, num_assignments, hidden, inter, stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_out,
            TOP_K, PRECISION, UPCAST, TMA, EVEN_K, FP8, ATOMIC, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _down_tile(
    act_ptr,
    act_desc,
    w_ptr,
    w_desc,
    s_ptr,
    weights_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    pid_m,
    pid_n,
    num_assignments,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (slot block, H tile) of ``_down_kernel``. FP8: the e4m3 weight tiles dequantized in registers by the
    block scales ``s_ptr`` (E, ceil(H / 128), ceil(I / 128))."""
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + slots)
    valid = ids < num_assignments
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slots[:, None].to(tl.int64) * stride_act + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
    b_row = (expert * hidden).to(tl.int32) + pid_n * BLOCK_N  # TMA: the tile's first row in (E * H, I)
    s_expert = s_ptr + expert * stride_se  # FP8: this expert's block scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if TMA:  # zero past I; rows past this expert's H only feed masked columns
            a = act_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = tl.trans(w_desc.load([b_row, k * BLOCK_K]))
        elif EVEN_K:  # no mask along K (see _gate_up_tile)
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            b = _dequantize(b, s_expert, offs_n, n_ok, k * BLOCK_K, stride_sn, act_ptr.dtype.element_ty, UPCAST)
        acc += dot(a, b, PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    scale = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    if ATOMIC:
        out_ptrs = out_ptr + (ids // TOP_K)[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.atomic_add(out_ptrs, acc, mask=valid[:, None] & n_ok[None, :], sem="relaxed")
    else:
        out_ptrs = out_ptr + ids[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | None = None,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts (shapes and result as ``fused_moe_ref``) by the kernels above; ``config`` overrides
    the tile config ``pick_config`` would choose. FP8 weights (both e4m3, with their float32 block scales
    w_gate_up_scale (E, ceil(2I / 128), ceil(H / 128)) and w_down_scale (E, ceil(H / 128), ceil(I / 128)), the
    layout of ``fnvllm.model.quant``): the activations stay in x's dtype and each weight tile is dequantized in
    registers (weight-only FP8: half the weight bytes of bf16, the products on the 16-bit tensor cores)."""
    _check_args(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or pick_config(num_tokens, w_gate_up.shape[0], top_k)
    if w_gate_up_scale is not None:
        _check_fp8_tiles(cfg)
    align = align_by_expert(topk_ids, w_gate_up.shape[0], cfg.block_m, cfg.align_programs, cfg.align_scan)
    act = moe_gate_up(x, w_gate_up, align, top_k, cfg, w_gate_up_scale)
    per_assignment = moe_down(act, w_down, topk_weights, align, cfg, w_down_scale)
    if cfg.atomic_combine:  # already summed per token, in float32
        return per_assignment.to(x.dtype)
    return combine(per_assignment.view(num_tokens, top_k, -1), cfg.combine_block, cfg.combine_warps)


def _stages(num_stages: int, dtype: torch.dtype) -> int:
    """Pipeline stages: the tiles are sized for 2-byte weights; 4-byte ones (fp32 models and tests) need half the
    stages to fit the shared memory of one SM (the decode tiles at 4 stages ask 240 KB of the H200's 227 KB)."""
    return num_stages if dtype.itemsize <= 2 else max(2, num_stages // 2)


_INTERPRETER_SMS = 3  # the CPU interpreter has no SMs: a few programs, each walking several tiles


def _programs(persistent: bool, tiles: int, device: torch.device, per_sm: int = 1) -> int:
    """Programs to launch: one per tile bound, or when ``persistent`` at most ``per_sm`` per SM, each walking the
    used tiles."""
    if not persistent:
        return tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _INTERPRETER_SMS
    return max(1, min(tiles, sms * per_sm))


def _descriptor(t: torch.Tensor, block: list[int]) -> Any:
    """A TMA tensor descriptor over the 2-D tensor ``t`` with tiles of ``block``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _tma_ok(cfg: MoeKernelConfig, *tensors: torch.Tensor) -> bool:
    """Whether the TMA path can run: asked for, on sm90+ (or the interpreter), every one of ``tensors``
    contiguous (the weights are viewed as 2-D) with its base and rows 16-byte aligned."""
    if not cfg.tma:
        return False
    if tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0 for t in tensors
    )


def _scale_args(w: torch.Tensor, w_scale: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """The kernels' (scale pointer, expert stride, row-block stride): ``w_scale``'s, or for 16/32-bit weights the
    weight itself with zero strides (the kernels never read it: FP8 is off)."""
    if w_scale is None:
        return w, 0, 0
    return w_scale, w_scale.stride(0), w_scale.stride(1)


def moe_gate_up(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    align: ExpertAlignment,
    top_k: int,
    cfg: MoeKernelConfig,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up of every assignment, (slots, I) in ``align``'s slot order (padding rows unwritten);
    ``w_scale``: the block scales of an e4m3 ``w_gate_up`` (see ``fused_moe``)."""
    (num_experts, inter2, hidden), inter = w_gate_up.shape, w_gate_up.shape[1] // 2
    num_m, n = align.block_experts.numel(), x.shape[0] * top_k
    act = torch.empty(align.sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)  # (slots, I)
    tma = _tma_ok(cfg, w_gate_up)
    fused = tma and cfg.fused_gate_up
    if fused:  # one (1, 2, BLOCK_N, BLOCK_K) box: a gate tile and the matching up tile, zero past I and H
        desc = _descriptor(w_gate_up.view(num_experts, 2, inter, hidden), [1, 2, cfg.block_n, cfg.block_k])
    else:
        desc = _descriptor(w_gate_up.view(num_experts * inter2, hidden), [cfg.block_n, cfg.block_k]) if tma else None
    scale, stride_se, stride_sn = _scale_args(w_gate_up, w_scale)
    grid = (_programs(cfg.persistent, num_m * triton.cdiv(inter, cfg.block_n), x.device, cfg.programs_per_sm),)
    _gate_up_kernel[grid](
        x, w_gate_up, desc, scale, act, align.sorted_ids, align.block_experts, align.num_slots, n, num_m, hidden,
        inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), stride_se, stride_sn, act.stride(0),
        TOP_K=top_k, PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot(x.device), TMA=tma, FUSED=fused,
        EVEN_K=hidden % cfg.block_k == 0, FP8=w_scale is not None, PERSISTENT=cfg.persistent, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=_stages(cfg.num_stages, x.dtype), USE_PDL=use_pdl(x.device), **pdl_launch(x.device),
    )  # fmt: skip
    return act


def moe_down(
    act: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    align: ExpertAlignment,
    cfg: MoeKernelConfig,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight * (act . down_e) of every assignment, (T*K, H) in assignment order (a = t*K + k); with
    ``cfg.atomic_combine`` already summed per token, (T, H) float32. ``w_scale``: the block scales of an e4m3
    ``w_down`` (see ``fused_moe``)."""
    (num_experts, hidden, inter), n = w_down.shape, topk_weights.numel()
    num_m, (num_tokens, top_k) = align.block_experts.numel(), topk_weights.shape
    if cfg.atomic_combine:
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=act.device)  # (T, H)
    else:
        out = torch.empty(n, hidden, dtype=act.dtype, device=act.device)  # (T*K, H)
    tma = _tma_ok(cfg, w_down, act)
    act_desc = _descriptor(act, [cfg.block_m, cfg.down_k]) if tma else None
    w_desc = _descriptor(w_down.view(num_experts * hidden, inter), [cfg.down_n, cfg.down_k]) if tma else None
    scale, stride_se, stride_sn = _scale_args(w_down, w_scale)
    grid = (
        _programs(cfg.down_is_persistent, num_m * triton.cdiv(hidden, cfg.down_n), act.device, cfg.programs_per_sm),
    )
    _down_kernel[grid](
        act, act_desc, w_down, w_desc, scale, topk_weights.reshape(-1), out, align.sorted_ids, align.block_experts,
        align.num_slots, n, num_m, hidden, inter, act.stride(0), w_down.stride(0), w_down.stride(1), stride_se,
        stride_sn, out.stride(0), TOP_K=top_k, PRECISION=dot_precision(act.dtype), UPCAST=upcast_dot(act.device),
        TMA=tma, EVEN_K=inter % cfg.down_k == 0, FP8=w_scale is not None, ATOMIC=cfg.atomic_combine,
        PERSISTENT=cfg.down_is_persistent,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, GROUP_M=cfg.group_m,
        num_warps=cfg.down_num_warps or cfg.num_warps,
        num_stages=_stages(cfg.down_num_stages or cfg.num_stages, act.dtype), USE_PDL=use_pdl(act.device),
        **pdl_launch(act.device),
    )  # fmt: skip
    return out


def combine(per_assignment: torch.Tensor, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """(T, K, H) -> (T, H): each token's K weighted expert outputs summed in float32 in k order, rounded once;
    ``block`` columns (a power of two, capped at H's) per program."""
    num_tokens, top_k, hidden = per_assignment.shape
    if block < 16 or block & (block - 1):
        raise ValueError(f"combine block must be a power of two >= 16, got {block}")
    out = torch.empty(num_tokens, hidden, dtype=per_assignment.dtype, device=per_assignment.device)
    block = min(block, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        per_assignment, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=num_warps,
        USE_PDL=use_pdl(out.device), **pdl_launch(out.device),
    )  # fmt: skip
    return out


@triton.jit
def _combine_kernel(src_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, cols] = sum_k src[t, k, cols] for token program_id(0) and column block program_id(1). The K loads
    are unrolled so all are in flight at once, and marked evict-first (each byte is read once)."""
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        src = src_ptr + (t * TOP_K + k) * hidden + cols
        acc += tl.load(src, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> None:
    """Raise ValueError naming the argument when shapes, dtypes or strides do not fit the kernels."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x must be (T, H), weights (E, 2I, H) and (E, H, I); got {x.shape}, {w_gate_up.shape}, "
                         f"{w_down.shape}")  # fmt: skip
    (num_tokens, hidden), (num_experts, inter2, w_hidden) = x.shape, w_gate_up.shape
    if w_hidden != hidden or inter2 % 2 or tuple(w_down.shape) != (num_experts, hidden, inter2 // 2):
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit x {tuple(x.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be (T={num_tokens}, K); got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")  # fmt: skip
    if w_gate_up_scale is not None or w_down_scale is not None:
        _check_fp8_args(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    elif x.dtype != w_gate_up.dtype or x.dtype != w_down.dtype:
        raise ValueError(f"x, w_gate_up and w_down must share a dtype; got {x.dtype}, {w_gate_up.dtype}, "
                         f"{w_down.dtype}")  # fmt: skip
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_weights", topk_weights)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")
    if not topk_weights.is_contiguous():
        raise ValueError("topk_weights must be contiguous")


def _check_fp8_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
) -> None:
    """ValueError naming the argument unless both weights are e4m3 with float32 block scales of their shapes and x
    is 16/32-bit (weight-only FP8)."""
    if w_gate_up_scale is None or w_down_scale is None:
        raise ValueError("FP8 experts need both w_gate_up_scale and w_down_scale (or neither, for 16/32-bit weights)")
    if w_gate_up.dtype != FP8_DTYPE or w_down.dtype != FP8_DTYPE:
        raise ValueError(
            f"with scales, w_gate_up and w_down must be {FP8_DTYPE}; got {w_gate_up.dtype}, {w_down.dtype}"
        )
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16 with FP8 weights; got {x.dtype}")
    for name, w, scale in (("w_gate_up_scale", w_gate_up, w_gate_up_scale), ("w_down_scale", w_down, w_down_scale)):
        expected = (w.shape[0], triton.cdiv(w.shape[1], SCALE_BLOCK), triton.cdiv(w.shape[2], SCALE_BLOCK))
        if tuple(scale.shape) != expected or scale.dtype != torch.float32 or scale.stride(-1) != 1:
            raise ValueError(
                f"{name} must be float32 {expected} (one scale per 128 x 128 block), contiguous in its last dim; "
                f"got {scale.dtype} {tuple(scale.shape)} with strides {scale.stride()}"
            )


def _check_fp8_tiles(cfg: MoeKernelConfig) -> None:
    """ValueError naming the field unless every K tile lies in one 128-column scale block (a power of two <= 128),
    so that one scale per weight row serves a tile (``_dequantize``)."""
    for name, block_k in (("block_k", cfg.block_k), ("down_block_k", cfg.down_k)):
        if block_k > SCALE_BLOCK or SCALE_BLOCK % block_k:
            raise ValueError(f"FP8 experts need {name} to divide {SCALE_BLOCK} (16, 32, 64 or 128), got {block_k}")
