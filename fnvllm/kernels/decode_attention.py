"""Paged decode attention (one query token per sequence), built for KV-read bandwidth: split-K in Triton.

Algorithm (flash-decoding). Each sequence's context is cut into partitions of `partition_size` tokens; one
program per (sequence b, KV head h, partition p), on a grid (Hkv, B, P) (or (B, Hkv, P), see `heads_inner`)
with P = ceil(max_blocks * block_size / partition_size), a function of shapes only, so the launcher never reads
seq_lens and can be captured in a CUDA graph. Program (b, h, p):
  1. exits at once when its partition starts at or past seq_lens[b] (it reads no KV and writes nothing; a
     sequence of length 0 gets zeros from partition 0);
  2. loads the G = Hq / Hkv query heads that share KV head h, (G, D), padded to GROUP_PAD rows;
  3. walks its partition in tiles of `tile_size` tokens; each K/V tile of head h is read once through the block
     table and serves all G heads, either with tl.dot (G padded to 16 rows: tensor cores) or with broadcast
     products and tl.sum (CUDA cores, no padding) -- `gqa_mode` "dot" or "sum";
  4. keeps an online softmax in float32, base 2 (scores times scale * log2(e), exp2);
  5. when the sequence fits in one partition, writes the normalised output directly; otherwise writes its
     normalised partial output and its log-sum-exp to the workspace.
The live partitions of a sequence with two or more are then combined:
  out = sum_p 2^(lse_p - M) * o_p / sum_p 2^(lse_p - M), with M = max_p lse_p,
by the partition program that finishes last (fused_reduce: each one adds 1 to an arrival counter of its
(sequence, KV head) after writing its partial; the one that reads num_live - 1 merges and resets the counter to
0), which saves a launch per layer, or by a second kernel, grid (B, Hq). On the H200 the in-kernel merge wins
from 16 sequences up (B 16: 18.6 vs 19.5 us a layer, B 64: 46.6 vs 47.9) and loses at one (6.1 vs 5.9: one
program merges serially what the reduce kernel spreads over Hq programs), so by default tiny batches keep the
reduce kernel (``fuses_reduce``).
The reduce learns how many partitions are live from seq_lens itself, so dead partitions need no marker. When
P == 1 (every table fits one partition) the reduce kernel is not launched at all.

Tokens reach their slot through the block table: token t of sequence b lives at
block_tables[b, t // block_size], row t % block_size. A tile that lies inside one block (tile_size divides
block_size) reads one block id; a tile that spans several blocks gathers one id per token. Either way each
token's (D,) row of one KV head is one contiguous read, since the cache is (num_blocks, block_size, Hkv, D).

Worked example: block_size 16, block_tables of width 8 (128 slots), partition_size 64 -> P = 2. A sequence of
length 70 runs partitions 0 (tokens 0..63, blocks table[0..3]) and 1 (tokens 64..69, block table[4]); both
write partials and the reduce merges them. A sequence of length 40 runs partition 0 only (partition 1 exits)
and writes its output directly; the reduce skips it. A padding row of length 0 writes zeros from partition 0.

Sliding window (``window``: w tokens, a compile-time constant of the launch, so a CUDA graph replays it): the query
at position L - 1 sees keys L - w .. L - 1 (``window_start``). A partition that ends at or before L - w exits as one
past the end does (no KV read), a live one starts at the tile holding L - w (its tokens before L - w masked out of
the loads), and the live partitions (L - w) // partition_size .. are the ones merged. Same example with w 20
(tile 16): the sequence of length 70 sees tokens 50..69; partition 0 reads its tiles 48..63 only, partition 1
tokens 64..69, and both are merged; the KV blocks before the window are allocated as ever (not freed).

Tried and dropped (H200, 2026-12-02, benchmarks/sweep_small.py): doing norm_rope_store's work (q/k norms, rotary,
the K/V store) inside this kernel, one launch fewer per layer (commit 9dfb9fd): the whole Qwen3-0.6B decode step
measured slower at B = 1 / 16 / 64 (809.5 / 1154.2 / 1657.5 us against 799.3 / 1139.2 / 1574.1), since every
partition program then waits for the qkv projection before it can form its q.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from fnvllm.env import env_choice
from fnvllm.kernels.attention import KVCache, _decode_attention, check_same_layout, check_window
from fnvllm.kernels.fp8 import check_kv_scales, is_fp8
from fnvllm.kernels.fused_ops import gpu_model, pdl_launch, use_pdl, wait_for_previous_kernel
from fnvllm.kernels.store_kv import e4m3_bits

GqaMode = Literal["dot", "sum", "kq"]
Fp8Path = Literal["mma", "wgmma_qk8", "mma_pairs", "mma_v16", "mma_eo"]
FP8_PATHS: tuple[str, ...] = ("mma", "wgmma_qk8", "mma_pairs", "mma_v16", "mma_eo")
_LOG2E = math.log2(math.e)
_REDUCE_CHUNK = 16  # partitions merged per step of the reduce loop
_MERGE_ELEMENTS = 4096  # float32 partial values a fused merge holds per step (G x chunk x D; ~32 per thread)
_MERGE_M0 = tl.constexpr(-1.0e30)  # the merges' initial running max: finite, below any lse


# Split-K arrival counters (int32), per device: zero between launches, since the last program of each counted
# group resets its counter. Launches on one stream run one after another, so one buffer serves every kernel that
# counts (the decode partitions here, the skinny GEMM's K splits).
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NUM_COUNTERS = 1 << 16


def split_counters(device: torch.device, num_counters: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, at least ``num_counters``, on ``device``: the device's shared buffer, or a
    fresh one (zeroed by a memset node of the graph) while a CUDA graph is being captured and none exists yet.

    Kernels that count must not run concurrently on two streams of one device."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < num_counters:
        fresh = torch.zeros(max(_NUM_COUNTERS, num_counters), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh
        _COUNTERS[device] = buf = fresh
    return buf


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch knobs of the decode kernel; every launcher default comes from DEFAULT_DECODE_CONFIG.

    partition_size: tokens per split-K partition (a power of two, >= tile_size).
    tile_size: tokens per K/V tile inside a partition (a power of two, >= 16 for "dot" and "kq").
    num_warps / num_stages: Triton launch options of the partition kernel (stages pipeline the tile loop).
    gqa_mode: "dot" serves the G heads of a KV group with tl.dot (G padded to 16 rows), "kq" with the transposed
        products S^T = K q^T and out^T = V^T P^T (``attend_tile_kq``: the tile's tokens are the rows, the G heads
        the columns, padded to 8; an FP8 cache's K and V both widened to float16 where loaded), "sum" with broadcast
        products and tl.sum (G padded to a power of two). "kq" is opt-in: its FP8 tile loop is the leanest in SASS
        (370 instructions a warp per 64 tokens against "mma"'s 1,145 per 128, ``benchmarks/sass_count.py``), yet on an
        H100 it ran slower (BENCHMARKS.md, twenty-eighth session: B 256 FP8 237 against 214 us, bf16 407 against
        394; the whole decode step at 16 requests +7 %), bound by restaging the widened tiles through shared memory
        (``ncu``: L1/TEX 84 %, DRAM 55 %), and 30 % slower on the H100 at an H200's bytes per SM (88-96 SMs,
        twenty-ninth session); the H200 itself is not measured.
    prefetch: issue tile i+1's K/V loads before consuming tile i (a register double buffer): an alternative to
        num_stages, whose cp.async pipelining it replaces (use it with num_stages=1).
    heads_inner: order the grid (Hkv, B, P) so that consecutive programs are the KV heads of one sequence and
        partition, reading neighbouring bytes of the same cache rows at the same time (DRAM page locality);
        False orders it (B, Hkv, P).
    fused_reduce: the last partition of a split (sequence, KV head) to finish merges the partials itself (an
        atomic arrival counter per pair); False launches the separate reduce kernel (grid (B, Hq)) instead; None
        picks by shape (``fuses_reduce``).
    preload_kv: read each partition's first K/V tile before the programmatic-dependent-launch wait (all but this
        step's token, which is read after it), so it streams while the previous kernel (the K/V store) finishes.
        Only for callers whose kernel right before stores nothing but this step's tokens into the caches (the
        decoder layer's norm_rope_store / store_kv). Off in every shipped entry: faster alone at one sequence, slower
        in the whole step (``SMALL_BATCH_DECODE``'s note).
    fp8_path: how an FP8 cache's tiles are multiplied (ignored for 16-bit caches; other than "mma" and "mma_eo"
        needs gqa_mode "dot"):
        "mma": q K^T and P V with the tiles widened to float16 in the dot operands' registers (mma.sync);
        "wgmma_qk8": transposed, S^T = K q^T and out^T = V^T P^T (the tile's tokens as the rows of the first
        product, so Hopper's warpgroup MMA applies), K multiplied as stored in e4m3 with q rounded to e4m3 (its
        rounding adds to the error, see docs/fp8.md), V widened to float16 where loaded (``widen_e4m3``);
        "mma_pairs": as "mma", but each program serves two neighbouring KV heads (``_decode_pairs_kernel``), so
        it reads 2 x D contiguous bytes of every token row instead of D (an even Hkv only).
        "mma_v16": as "mma", but V is widened to float16 where it is read from shared memory in its loaded layout
        (``widen_e4m3``'s PTX, which Triton keeps in place), so Triton stages the float16 tile through shared memory
        and reads it transposed with ``ldmatrix``, where "mma" reads the e4m3 tile byte by byte in the dot operand's
        layout (``benchmarks/sass_count.py``: 128 single-byte shared loads a warp per tile of 128); for 16-bit q
        (float32 q takes "mma"). Measured on an H100 only (BENCHMARKS.md, twenty-eighth session): as fast as "mma"
        at tiles of 64 and 3 stages (214.1 against 214.3 us at B 256), slower at other knobs.
        "mma_eo" (the default): as "mma", but the tiles are read as int16 pairs of e4m3 bytes and each pair widens
        in place (``split_e4m3_pairs``: one byte permute and two packed conversions a 32-bit word) into the even
        and odd columns, which multiply separately (``attend_tile_eo``: q K^T = q_even K_even^T + q_odd K_odd^T,
        and P V's even and odd output columns): Triton then reads both operands from shared memory with
        ``ldmatrix``, where "mma" reads them byte by byte. 661 SASS instructions a warp per tile of 128 against
        1,145 (``benchmarks/sass_count.py``, Triton 3.6). For 16-bit q, gqa_mode "dot" and head_dim >= 32 (else it
        computes as "mma"). Measured on an H100 (BENCHMARKS.md, twenty-ninth session; B 256, longest first):
        217.5 against 224.0 us on all 132 SMs, and 215.4 against 258.1 us on 88 SMs (a CUDA green context: an
        H200's bytes per SM), level with a plain read of the same bytes there (213.4).
        Measured on the H200 (docs/fp8.md): "wgmma_qk8" as fast as "mma", not faster.
    """

    partition_size: int = 512
    tile_size: int = 64
    num_warps: int = 4
    num_stages: int = 3
    gqa_mode: GqaMode = "dot"
    prefetch: bool = False
    heads_inner: bool = True
    fused_reduce: bool | None = None
    preload_kv: bool = False
    fp8_path: Fp8Path = "mma"


# Why these defaults (first choices for an H200 at B=256, context U(100, 2048), Hkv 8, D 128, bf16, checked only by
# compiling for sm_90 on a CPU machine; benchmarks/bench_attention.py sweeps them on the GPU):
# - partition 512: 256 KiB of K+V per program, while 256 seqs x 8 heads x ~2.6 live partitions ~ 5,000 programs
#   still keep 132 SMs busy and leave the reduce little to merge;
# - tile 64 with 3 stages: Triton's pipeliner stages K/V tiles through shared memory with cp.async (32 KiB a
#   stage, 70 KiB a program), so two tiles are in flight per program and 3 programs fit an SM (80-112 registers
#   a thread at 4 warps); prefetch=True (register double buffer) gets no cp.async pipelining and more registers;
# - "dot": the (16, D) x (D, 64) score and (16, 64) x (64, D) output products run on tensor cores; "sum" needs
#   255 registers at tile 64 (spills), so it only makes sense with tiles of 16-32 (189 registers at 32);
# - heads_inner: the 8 programs of one (sequence, partition) read the 8 x 256-byte head slices of the same 2 KiB
#   token rows together.
DEFAULT_DECODE_CONFIG = DecodeKernelConfig()
# The knobs for FP8 caches (half the bytes a tile): tiles of 128 tokens, the best of benchmarks/bench_fp8_kv.py's
# sweep on the H200 (BENCHMARKS.md, "FP8 decode attention").
# FNVLLM_FP8_PATH picks the default ``fp8_path`` (one of FP8_PATHS; "mma_eo" when unset), to measure a path end to
# end.
FP8_PATH_DEFAULT = env_choice("FNVLLM_FP8_PATH", FP8_PATHS, "mma_eo")
DEFAULT_FP8_DECODE_CONFIG = dataclasses.replace(DEFAULT_DECODE_CONFIG, tile_size=128, fp8_path=FP8_PATH_DEFAULT)

# A batch whose (sequence, KV head) programs already number this many fills the GPU several times over without
# splitting (132 SMs x ~3 resident programs each, ~2.5 waves), so the launcher gives each sequence one partition:
# no partial outputs, no reduce. Measured on the H200 (B 256, Hkv 8, context U(100, 2048), block 256): one
# partition 4.11 TB/s, partitions of 512 tokens 3.99 TB/s plus 10 us of reduce per layer.
SPLIT_FREE_PROGRAMS = 1024
# Batches of at most TINY_BATCH_PAIRS (sequence, KV head) pairs split into partitions of one default tile, with at
# most SMALL_BATCH_MAX_PARTIALS partial outputs per head group.
TINY_BATCH_PAIRS = 32
SMALL_BATCH_PARTITION = 64
SMALL_BATCH_MAX_PARTIALS = 1 << 16


def auto_partition_size(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """The partition size the launcher uses when none is given, from shapes only (a CUDA graph captured for a
    batch size keeps its choice):
    - batches of >= SPLIT_FREE_PROGRAMS (sequence, KV head) pairs: one partition covering ``max_context`` (the
      table width in tokens);
    - tiny batches (<= TINY_BATCH_PAIRS pairs): partitions of one tile (SMALL_BATCH_PARTITION tokens), so even
      one sequence spreads its context over many programs, doubled while the partial outputs would exceed
      SMALL_BATCH_MAX_PARTIALS (sequence, KV head, partition) triples (long tables). On the H200 this halves a
      one-sequence step's attention at long contexts, while from 16 sequences up the finer split loses
      (benchmarks/bench_small_batch.py; BENCHMARKS.md, "decode attention partitions"), so they keep the default;
    - otherwise the default partition size.
    Worked example: B 256 x Hkv 8 = 2048 pairs, tables of 4096 slots -> 4096 (P = 1); B 16 -> 512 (P = 8);
    B 1 -> 64 (P = 64).
    """
    if num_seqs * num_kv_heads >= SPLIT_FREE_PROGRAMS:
        return max(DEFAULT_DECODE_CONFIG.partition_size, int(triton.next_power_of_2(max_context)))
    if num_seqs * num_kv_heads > TINY_BATCH_PAIRS:
        return DEFAULT_DECODE_CONFIG.partition_size
    size = SMALL_BATCH_PARTITION
    while size < max_context and num_seqs * num_kv_heads * math.ceil(max_context / size) > SMALL_BATCH_MAX_PARTIALS:
        size *= 2
    return size


# Small batches of 16-bit caches, measured on the H200 (benchmarks/sweep_small.py, part 3: B = 1, 16, 64, contexts
# U(100, 400) and U(100, 1024), tables 16 blocks of 256, PDL on, 2026-12-01 23:50): the launch knobs by batch
# bucket (the entry of the smallest key >= B), replacing ``auto_partition_size`` and ``fuses_reduce`` there
# (partition_size capped at the table's width), chosen by the least time summed over both contexts. B = 16:
# 256-token partitions merged in-kernel, 29.8 us against 32.7 (auto: 512, in-kernel); B = 64: 1024-token
# partitions, 77.4 against 78.0. One sequence keeps the automatic rules (None: 64-token partitions and the reduce
# kernel, 10.0 us against 10.1 for the best other knobs). Rechecked 2026-12-02 02:15 at the latency bench's
# contexts U(100, 384) with 20 knob sets, ``preload_kv`` among them: alone, one sequence's attention took 4.83 us
# preloaded against 5.00 and 16 sequences' 9.74 (one 4096-token partition, 128-token tiles, preloaded) against
# 12.46, but the whole decode step with the one-sequence pick measured 797.6 us against 785.9 (the 16-sequence pick
# fails the U(100, 1024) guard, 22.3 against 17.0), so the entries stand.
SMALL_BATCH_DECODE: dict[int, DecodeKernelConfig | None] = {
    1: None,
    16: DecodeKernelConfig(partition_size=256, tile_size=64, num_warps=4, num_stages=3, fused_reduce=True),
    64: DecodeKernelConfig(partition_size=1024, tile_size=64, num_warps=4, num_stages=3, fused_reduce=True),
}


# FP8 caches at mid-size batches, measured on the H200 (benchmarks/sweep_decode_mid.py, 2026-12-02 05:20: B
# sequences of contexts U(300, 2000), tables 16 blocks of 256, CUDA-graph replays, 35 knob sets each, Hq 16 and 32
# over Hkv 8 agreeing): us per launch, launcher default -> this entry, at Hq 16 / 32: B = 16 28.0 -> 26.9 / 27.4 ->
# 26.6; 32 44.2 -> 40.6 / 43.6 -> 40.3; 64 72.2 -> 68.1 / 72.4 -> 67.4; 96 98.3 -> 92.0 / 97.4 -> 90.8; 128 118.4 ->
# 117.7 / 118.4 -> 116.4; from 192 up the defaults (one partition of 128-token tiles) were within 0.7 % of the best.
# Batches of at most 4 (<= TINY_BATCH_PAIRS pairs at Hkv 8) keep the automatic rules (64-token partitions). Same
# bucket rule as SMALL_BATCH_DECODE; the FP8 path (``FNVLLM_FP8_PATH``) is kept.
SMALL_BATCH_DECODE_FP8: dict[int, DecodeKernelConfig | None] = {
    4: None,
    16: dataclasses.replace(DEFAULT_FP8_DECODE_CONFIG, partition_size=512, num_stages=2, fused_reduce=True),
    32: dataclasses.replace(DEFAULT_FP8_DECODE_CONFIG, partition_size=1024, num_stages=2, fused_reduce=True),
    64: dataclasses.replace(DEFAULT_FP8_DECODE_CONFIG, partition_size=512, tile_size=64, fused_reduce=True),
    96: dataclasses.replace(DEFAULT_FP8_DECODE_CONFIG, partition_size=512, tile_size=64, fused_reduce=True),
    128: dataclasses.replace(DEFAULT_FP8_DECODE_CONFIG, partition_size=512, tile_size=64, fused_reduce=True),
}


# Short tables. A knob set that wins only while every context is short fails the longer-context guard above, but
# a table of at most SHORT_CONTEXT tokens cannot hold a longer one: decode CUDA graphs of the batch sizes below are
# captured twice, at full width and at SHORT_CONTEXT tokens (``short_graph_widths``; fnvllm.executor.cuda_graphs),
# and a step whose contexts all fit replays the short one, whose launch takes these knobs (as does an eager step
# with such tables). By (fewest, most) sequences: the entry for 9-16 is the best of sweep_small.py's 20 knob sets at
# 16 sequences of contexts U(100, 384) (BENCHMARKS.md, fifth session: one partition, 64-token tiles, merged
# in-kernel, first tile read before the launch wait): 9.76 us against 12.32 for SMALL_BATCH_DECODE's entry (which
# keeps the long tables: 16.33 us at U(100, 1024) against 19.48 for this one). The entry for 49-64 takes 32-token
# tiles, so that a program holds 37 KiB of shared memory instead of 70 and the batch's 392-512 (sequence, KV head)
# programs fit the GPU at once (4 an SM, where 64-token tiles fit 3: 396 programs, so 64 rows ran 1.3 waves);
# measured on the H200 (BENCHMARKS.md, twelfth session; 512-token tables, us per launch, the 64-row entry of
# SMALL_BATCH_DECODE -> this one): 64 sequences at U(228, 256) 22.41 -> 19.28, U(356, 384) 31.07 -> 27.59,
# U(100, 384) 24.04 -> 21.94; at 48 sequences (384 programs, one wave either way) it lost (15.66 -> 16.40), and at
# 32 it won alone (13.70 -> 11.82) but not in the whole step (1.364-1.368 -> 1.381 device ms). 16-bit caches only.
SHORT_CONTEXT = 512
SMALL_BATCH_DECODE_SHORT: dict[tuple[int, int], DecodeKernelConfig] = {
    (9, 16): DecodeKernelConfig(
        partition_size=SHORT_CONTEXT, tile_size=64, num_warps=4, num_stages=3, fused_reduce=True, preload_kv=True
    ),
    (49, 64): DecodeKernelConfig(
        partition_size=SHORT_CONTEXT, tile_size=32, num_warps=4, num_stages=3, fused_reduce=True, preload_kv=True
    ),
}


# GPU model (``torch.cuda.get_device_name``, exactly) -> entries that take the place of SMALL_BATCH_DECODE_SHORT's
# for the same sequence counts on that model (never new ranges: which batch sizes get a short capture does not depend
# on the GPU), each measured there in the whole decode step against the entry it replaces. A model not named here
# takes SMALL_BATCH_DECODE_SHORT as it is. H100: the entries' other knobs swept in the whole step (BENCHMARKS.md,
# twenty-fourth session, call 3), then the two that led run again beside base in two more calls (twenty-seventh
# session); random Qwen3-0.6B checkpoint, device ms per decode step, three calls:
# - 9-16 sequences without the first tile read before the wait: 16 requests 1.114 / 1.132 / 1.134 against
#   1.120 / 1.137 / 1.142;
# - 49-64 sequences at 2 stages: 64 requests 1.671 / 1.690 / 1.693 against 1.679 / 1.702 / 1.705.
DEVICE_SHORT_CONFIGS: dict[str, dict[tuple[int, int], DecodeKernelConfig]] = {
    "NVIDIA H100 80GB HBM3": {
        (9, 16): dataclasses.replace(SMALL_BATCH_DECODE_SHORT[(9, 16)], preload_kv=False),
        (49, 64): dataclasses.replace(SMALL_BATCH_DECODE_SHORT[(49, 64)], num_stages=2),
    },
}


def short_table_config(num_seqs: int, max_context: int, fp8: bool, gpu: str | None = None) -> DecodeKernelConfig | None:
    """The ``SMALL_BATCH_DECODE_SHORT`` knobs for num_seqs sequences whose tables hold at most SHORT_CONTEXT
    tokens (16-bit caches), ``DEVICE_SHORT_CONFIGS``' in their place on the GPU model ``gpu`` where it lists them;
    None otherwise."""
    if fp8 or not 0 < max_context <= SHORT_CONTEXT:
        return None
    rows = next((key for key in SMALL_BATCH_DECODE_SHORT if key[0] <= num_seqs <= key[1]), None)
    if rows is None:
        return None
    return DEVICE_SHORT_CONFIGS.get(gpu or "", {}).get(rows, SMALL_BATCH_DECODE_SHORT[rows])


def short_graph_widths(buckets: Sequence[int], block_size: int, max_context: int, fp8: bool) -> dict[int, int]:
    """Decode graph buckets that get a second capture with short tables, and that table width in blocks: buckets
    whose rows take a ``SMALL_BATCH_DECODE_SHORT`` entry, when SHORT_CONTEXT is a whole number of blocks below
    the full tables' max_context tokens (else the full capture is already short, or the short one cannot be)."""
    width = SHORT_CONTEXT // block_size
    if fp8 or SHORT_CONTEXT % block_size or max_context <= SHORT_CONTEXT:
        return {}
    return {b: width for b in buckets if short_table_config(b, SHORT_CONTEXT, fp8) is not None}


def small_batch_config(num_seqs: int, max_context: int, fp8: bool, gpu: str | None = None) -> DecodeKernelConfig | None:
    """The measured knobs for a batch of num_seqs sequences (``short_table_config`` for short tables, on the GPU
    model ``gpu``, else ``SMALL_BATCH_DECODE``, or ``SMALL_BATCH_DECODE_FP8`` for FP8 caches), partition capped at
    the table's max_context tokens (a power of two); None (the automatic rules) for unmeasured batch sizes, buckets
    whose entry is None and empty tables."""
    table = SMALL_BATCH_DECODE_FP8 if fp8 else SMALL_BATCH_DECODE
    bucket = next((b for b in sorted(table) if b >= num_seqs), None)
    if bucket is None or num_seqs <= 0:
        return None
    cfg = short_table_config(num_seqs, max_context, fp8, gpu) or table[bucket]
    if cfg is None:
        return None
    cap = max(cfg.tile_size, int(triton.next_power_of_2(max(1, max_context))))
    return dataclasses.replace(cfg, partition_size=min(cfg.partition_size, cap))


# Launches of at least this many (sequence, KV head) programs over an FP8 cache, one partition per sequence, take
# the sequences longest first when the step gives the order (``seq_order``). Measured on the H200 (branch h-f8a,
# bench_fp8_kv.py --variants, 2026-12-02; B 256, Hkv 8, contexts U(100, 2048)): 182.8 us with the order against
# 198.3 without (3.18 against 2.93 TB/s): the last wave of 2,048 programs of 100-2,048 tokens held long ones. The
# bf16 kernel measured no gain there (286.2 against 287.7 us).
ORDERED_MIN_PROGRAMS = SPLIT_FREE_PROGRAMS
# 16-bit caches from this many programs on, whatever the partitions: a launch of 1-2 waves, where the sequences'
# lengths differ several times over, ends on whichever SM drew the long ones. Measured on the H200 (BENCHMARKS.md,
# eleventh session; Hq 16 / Hkv 8, 256-token blocks, CUDA-graph replays past L2, us per launch,
# batch order -> longest first): B 64 at U(100, 384) 23.36 -> 20.77 with the 64-row knobs (4,096-token tables;
# 512-token tables 23.28 -> 20.98), at U(100, 1024) 47.69 -> 40.27; B 16 (128 programs, one wave) no gain.
ORDERED_MIN_PROGRAMS_16BIT = 256


def ordered_min_programs(fp8: bool) -> int:
    """The fewest (sequence, KV head) programs of a decode launch that takes its sequences longest first, for an
    FP8 or a 16-bit cache (``orders_longest_first``)."""
    return ORDERED_MIN_PROGRAMS if fp8 else ORDERED_MIN_PROGRAMS_16BIT


def orders_longest_first(num_seqs: int, num_kv_heads: int, num_parts: int, kv: KVCache) -> bool:
    """Whether a decode launch takes its sequences longest first when given the order: an FP8 cache with one
    partition per sequence and at least ORDERED_MIN_PROGRAMS (sequence, KV head) programs, or a 16-bit cache with
    at least ORDERED_MIN_PROGRAMS_16BIT."""
    fp8 = kv.k_scale is not None
    one_part = num_parts == 1 or not fp8
    return one_part and num_seqs * num_kv_heads >= ordered_min_programs(fp8)


# Every measured knob set above was chosen at head_dim 128 (Qwen3, Llama); a wider head (Gemma 3's 256) scales a
# pipeline stage's K/V bytes, and the shared memory a program asks for, with it. Measured on an H100 (BENCHMARKS.md,
# forty-third session): head_dim 256 with 64-token tiles and 3 stages asked for 282,688 bytes of shared memory, past
# the 232,448 an H100 / H200 block may hold (OutOfResources at launch).
TUNED_HEAD_DIM = 128


def tile_for_head_dim(tile_size: int, head_dim: int, min_tile: int = 16) -> int:
    """``tile_size`` (tuned at TUNED_HEAD_DIM) for a head of ``head_dim``: halved for each doubling past 128, so a
    stage holds the bytes it was tuned with, and never below ``min_tile`` (the dot products' least). Narrower
    heads keep their tile. Worked example: tile 64 at head_dim 256 -> 32 (the 282,688 bytes above -> about half);
    at 512 -> 16; 128-token FP8 tiles at 256 -> 64."""
    tile = tile_size
    while head_dim * tile > TUNED_HEAD_DIM * tile_size and tile > min_tile:
        tile //= 2
    return tile


def fuses_reduce(num_seqs: int, num_kv_heads: int) -> bool:
    """Whether split partials are merged in the partition kernel by default: above TINY_BATCH_PAIRS (sequence, KV
    head) pairs (measured on the H200: see the module docstring)."""
    return num_seqs * num_kv_heads > TINY_BATCH_PAIRS


class DecodeWorkspace(NamedTuple):
    """Preallocated split-K buffers (a CUDA graph can own them): float32 partial outputs and their lse.

    partial_out: (B, Hq, P, D) float32; partial_lse: (B, Hq, P) float32 (base-2 log-sum-exp).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def num_decode_partitions(block_tables: torch.Tensor, block_size: int, partition_size: int) -> int:
    """P = ceil(max_blocks * block_size / partition_size): partitions per sequence (from shapes only)."""
    return max(1, math.ceil(block_tables.shape[1] * block_size / partition_size))


def make_decode_workspace(
    q: torch.Tensor, block_tables: torch.Tensor, block_size: int, partition_size: int | None = None
) -> DecodeWorkspace:
    """Allocate the split-K workspace for q (B, Hq, D) and block_tables (B, max_blocks), for launches with this
    ``partition_size`` (None: DEFAULT_DECODE_CONFIG's; pass the same to ``paged_decode_attention``, whose own
    choice for small batches may differ)."""
    partition_size = partition_size or DEFAULT_DECODE_CONFIG.partition_size
    num_seqs, num_heads, head_dim = q.shape
    num_parts = num_decode_partitions(block_tables, block_size, partition_size)
    partial_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    return DecodeWorkspace(partial_out, partial_lse)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Torch reference: q (B, Hq, D) attends keys 0..seq_lens[b]-1 (with a sliding ``window``, the last window of
    them); rows of length 0 give zeros; (B, Hq, D). FP8 caches need their (Hkv,) scales."""
    check_kv_scales(k_cache, k_scale, v_scale)
    check_window(window)
    max_len = max(1, int(seq_lens.max())) if seq_lens.numel() else 1
    kv = KVCache(k_cache, v_cache, k_scale, v_scale)
    out = _decode_attention(q, kv, block_tables, seq_lens, max_len, scale, window)  # (B, Hq, D)
    return out.masked_fill(seq_lens[:, None, None] == 0, 0.0)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot(a, b) accumulated in float32; UPCAST first widens a and b to float32 (exactly, so the result is
    the same as the tensor-core product of the narrow inputs).

    UPCAST is on under the Triton CPU interpreter only, whose dot multiplies bfloat16 operands as their raw
    uint16 bit patterns (triton 3.9); the GPU path never upcasts.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dot_into(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, the product accumulating into acc (float32) in the MMA itself (no separate add, no zeroed
    accumulator); UPCAST as in ``dot``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def kv_tile_offsets(
    table_row_ptr,
    t0,
    limit,
    head,
    stride_cb,
    stride_ct,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """(TILE,) int64 cache offsets of tokens t0 .. t0+TILE-1 of KV head `head` (tokens >= limit are not looked up).

    table_row_ptr points at the sequence's block-table row; t0 is a multiple of TILE.
    """
    tok = t0 + tl.arange(0, TILE)
    if BLOCK_SIZE % TILE == 0:  # the tile lies inside one block: one block id
        block = tl.load(table_row_ptr + t0 // BLOCK_SIZE, mask=t0 < limit, other=0).to(tl.int64)
        offs = block * stride_cb + (t0 % BLOCK_SIZE + tl.arange(0, TILE)) * stride_ct
    else:  # the tile spans blocks: one block id per token
        block = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=tok < limit, other=0).to(tl.int64)
        offs = block * stride_cb + (tok % BLOCK_SIZE) * stride_ct
    return offs + head * stride_ch


@triton.jit
def next_tile_offsets(
    table_row_ptr,
    first,
    start,
    t0,
    limit,
    head,
    stride_cb,
    stride_ct,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """``kv_tile_offsets`` of the tile at t0 of the partition starting at `start`, whose first tile's offsets are
    `first`: when the partition lies inside one block (PARTITION_SIZE divides BLOCK_SIZE) they are `first` shifted
    by t0 - start rows, with no block-table read."""
    if BLOCK_SIZE % PARTITION_SIZE == 0:
        return first + (t0 - start) * stride_ct
    return kv_tile_offsets(table_row_ptr, t0, limit, head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, TILE)


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, offs, mask, HEAD_DIM: tl.constexpr):
    """K and V tiles (N, D) at cache offsets offs (N,); rows where mask (N,) is False read nothing (zeros)."""
    ptrs = offs[:, None] + tl.arange(0, HEAD_DIM)[None, :]  # (N, D)
    k = tl.load(k_cache_ptr + ptrs, mask=mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + ptrs, mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def softmax_step(s, m, l, scale_log2):
    """The online softmax's step over unscaled scores s (R, N): (new running max, the factor alpha (R,) that
    rescales what was accumulated under the old one, p (R, N), new running sum), all base 2.

    Fewer instructions a tile (the FP8 decode kernel is bound by them, BENCHMARKS.md, twenty-seventh session):
    scale_log2 > 0, so the row max of the scaled scores is the scaled row max (rounding is monotonic: the same
    bits), one product a row; and the exponent's s * scale_log2 - m_new is one FMA an element."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * scale_log2)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])  # (R, N)
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def attend_tile(
    q,
    k,
    v,
    visible,
    m,
    l,
    acc,
    scale_log2,
    MASKED: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step of rows q (R, D) over a K/V tile (N, D); returns the new (m, l, acc).

    m (R,) running max and l (R,) running sum, both base 2; acc (R, D) float32 unnormalised output. When MASKED,
    `visible` (R, N) or (1, N) says which scores count; every row must have seen at least one key by the end.
    """
    if USE_DOT:
        s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT)  # (R, N), unscaled
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # (R, N)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new, alpha, p, l = softmax_step(s, m, l, scale_log2)
    acc = acc * alpha[:, None]  # (P V then accumulates into the rescaled acc inside the MMA)
    if USE_DOT:
        return m_new, l, dot_into(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST_DOT)  # (R, D)
    return m_new, l, acc + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


# e4m3 -> float16 of 4 values in one 32-bit word: two cvt.rn.f16x2.e4m3x2 (sm_89+), no byte repacking.
_E4M3X4_TO_F16_ASM = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.jit
def widen_e4m3(x, ASM: tl.constexpr):
    """float8_e4m3fn x -> float16 (exact). ASM (GPU only): inline PTX on 32-bit words of 4 values in the layout
    x was loaded in (not pure, so Triton keeps it there), where Triton's cast repacks byte by byte."""
    if ASM:
        u = x.to(tl.uint8, bitcast=True)
        return tl.inline_asm_elementwise(_E4M3X4_TO_F16_ASM, "=r,=r,r", [u], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float16)


# Two e4m3 pairs of one 32-bit word (bytes b0 b1 | b2 b3: two int16 elements) -> the float16 pairs (b0, b2) and
# (b1, b3): one byte permute, two cvt.rn.f16x2.e4m3x2 (sm_89+).
_E4M3_PAIRS_SPLIT_ASM = tl.constexpr("""{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.jit
def split_e4m3_pairs(x, ASM: tl.constexpr):
    """int16 x (..., C) whose elements hold two e4m3 bytes each -> (its low bytes, its high bytes) as float16
    (..., C) (exact): an FP8 row's even and odd columns. ASM (GPU only): ``_E4M3_PAIRS_SPLIT_ASM`` on the words
    of two elements in the layout x was loaded in."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E4M3_PAIRS_SPLIT_ASM, "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def attend_tile_eo(
    q_lo, q_hi, k, v, visible, m, l, acc_lo, acc_hi, scale_log2, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """``attend_tile`` over an FP8 tile read as int16 pairs (fp8_path "mma_eo"): k, v (N, D/2) int16; the even
    and odd columns of K, V and q are multiplied separately (q K^T = q_even K_even^T + q_odd K_odd^T; P V's even
    and odd output columns are acc_lo, acc_hi (R, D/2)), so each int16 element widens in place with no byte
    regrouping. q_lo, q_hi (R, D/2) float16. Returns (m, l, acc_lo, acc_hi)."""
    k_lo, k_hi = split_e4m3_pairs(k, not UPCAST_DOT)
    s = dot(q_lo, tl.trans(k_lo), DOT_PRECISION, UPCAST_DOT)
    s = dot_into(q_hi, tl.trans(k_hi), s, DOT_PRECISION, UPCAST_DOT)  # (R, N)
    m_new, alpha, p, l = softmax_step(tl.where(visible, s, float("-inf")), m, l, scale_log2)
    v_lo, v_hi = split_e4m3_pairs(v, not UPCAST_DOT)
    p16 = p.to(tl.float16)
    acc_lo = dot_into(p16, v_lo, acc_lo * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
    acc_hi = dot_into(p16, v_hi, acc_hi * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
    return m_new, l, acc_lo, acc_hi


@triton.jit
def attend_tile_kq(
    qt,
    k,
    v,
    visible,
    m,
    l,
    acct,
    scale_log2,
    P_FP16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    K_E4M3: tl.constexpr,
):
    """One online-softmax step, transposed: scores S^T = K q^T (N, R) and acc^T (D, R) += V^T P^T, so the tile's
    N tokens (and D) are the first product's rows and the R (>= 8) padded heads its columns, where q K^T pads them
    to 16 rows: half the products and half the softmax's exponentials.

    k, v (N, D) tiles as stored. 16-bit caches: qt (D, R) in q's dtype, P rounded to V's dtype. FP8 caches (KV_FP8):
    V widened to float16 where loaded (``widen_e4m3``; then to float32 unless P_FP16, which also rounds P to
    float16), K likewise with qt in q's dtype, or, when K_E4M3, K multiplied as stored with qt rounded to e4m3.
    visible (N, 1); m, l (R,) base 2; acct (D, R) float32. Returns (m, l, acct)."""
    if K_E4M3:
        st = dot(k, qt, "tf32", UPCAST_DOT)  # (N, R), e4m3 x e4m3 on the GPU
    elif KV_FP8:
        st = dot(widen_e4m3(k, not UPCAST_DOT).to(qt.dtype), qt, DOT_PRECISION, UPCAST_DOT)
    else:
        st = dot(k, qt, DOT_PRECISION, UPCAST_DOT)
    st = tl.where(visible, st * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(st, axis=0))
    alpha = tl.exp2(m - m_new)
    pt = tl.exp2(st - m_new[None, :])  # (N, R)
    l = l * alpha + tl.sum(pt, axis=0)
    if KV_FP8:  # noqa: SIM108 (a compile-time branch)
        vt = tl.trans(widen_e4m3(v, not UPCAST_DOT).to(tl.float16 if P_FP16 else tl.float32))  # (D, N)
    else:
        vt = tl.trans(v)
    return m_new, l, dot_into(vt, pt.to(vt.dtype), acct * alpha[None, :], DOT_PRECISION, UPCAST_DOT)


@triton.jit
def window_start(seq_len, WINDOW: tl.constexpr):
    """The first key position the query at seq_len - 1 sees: seq_len - WINDOW (at least 0) under a sliding window
    of WINDOW tokens (key j is seen iff 0 <= seq_len - 1 - j < WINDOW), 0 when WINDOW is None."""
    start = seq_len * 0
    if WINDOW is not None:
        start = tl.maximum(seq_len - WINDOW, 0)
    return start


@triton.jit
def is_live_partition(start, seq_len, kv_start, PARTITION_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """Whether the partition of keys start .. start + PARTITION_SIZE - 1 holds a key the query sees: it starts
    before seq_len and, under a sliding window, ends after kv_start (``window_start``)."""
    live = start < seq_len
    if WINDOW is not None:
        live = live & (start + PARTITION_SIZE > kv_start)
    return live


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,  # (Hkv,) float32 dequantization scales of an FP8 cache (unread otherwise)
    v_scale_ptr,
    counter_ptr,  # (B * Hkv,) int32 arrival counters of the fused merge, zero between launches
    order_ptr,  # (B,) int32 the sequences longest first (ORDERED only)
    scale_log2,  # scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    num_heads,
    num_kv_heads,
    num_parts,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
    HEADS_INNER: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP16: tl.constexpr,
    KQ: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    MERGE_GROUP: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    PRELOAD_KV: tl.constexpr,
    ORDERED: tl.constexpr = False,
    V_WIDE: tl.constexpr = False,  # fp8_path "mma_v16" (FP8 cache, float16 q)
    K_E4M3: tl.constexpr = False,  # fp8_path "wgmma_qk8" (KQ)
    EO: tl.constexpr = False,  # fp8_path "mma_eo": caches passed as int16 views (strides in int16 elements)
    WINDOW: tl.constexpr = None,  # a sliding window in tokens (int >= 1), None for full attention
):
    """Attend the G query heads of one KV head over partition program_id(2) of one sequence (see HEADS_INNER).

    KV_FP8: the caches hold e4m3; tiles are widened to q's dtype (exactly) in registers, the key scale is folded
    into the softmax scale and the value scale into the output (both are one number per program's KV head).
    Q_FP16: q is converted to float16 first, so the tiles widen to float16 (see ``fp8_compute_fp16``).
    KQ: the transposed products of ``attend_tile_kq`` (gqa_mode "kq"); K_E4M3 (FP8 only): with K as stored and q
    rounded to e4m3 (fp8_path "wgmma_qk8").
    FUSED_REDUCE: a split sequence's partitions count themselves in on counter_ptr[seq * Hkv + kv_head], and the
    last live one merges all of them (``merge_partitions``) and resets the counter: no reduce kernel.
    PRELOAD_KV: under programmatic dependent launch, read seq_lens, the first tile's block id and the first tile
    of K/V before waiting for the previous kernel, so that DRAM read overlaps it: none of them is written by the
    kernel before (the step's inputs are copied before its first kernel, and a cached token's K/V was stored in an
    earlier step), except this step's own token at seq_len - 1, which the store kernel just wrote: that row is
    masked out of the preload and read after the wait.
    ORDERED: the grid's sequence index r serves sequence order_ptr[r] (a permutation of the batch, longest first:
    ``orders_longest_first``), so the launch's last wave holds short sequences; the order is a step input, copied
    before the step's first kernel, so it is read before the wait.
    EO: the caches are int16 views of e4m3 (``attend_tile_eo``), a token row D / 2 elements.
    WINDOW: the query (at seq_len - 1) sees keys seq_len - WINDOW .. seq_len - 1 only (``window_start``): a partition
    wholly before them exits like one past the end, and a live one starts at the tile holding the first of them,
    masking the tokens before it (not read). Not with PRELOAD_KV (its peeled first tile is the partition's)."""
    tl.static_assert(WINDOW is None or not PRELOAD_KV, "a sliding window is not read with PRELOAD_KV")
    KV_COLS: tl.constexpr = HEAD_DIM // (1 + EO)  # cache elements a tile row
    if HEADS_INNER:
        kv_head = tl.program_id(0)
        rank = tl.program_id(1)
    else:
        rank = tl.program_id(0)
        kv_head = tl.program_id(1)
    if ORDERED:  # noqa: SIM108 (a compile-time branch)
        seq = tl.load(order_ptr + rank)
    else:
        seq = rank
    part = tl.program_id(2)
    start = part * PARTITION_SIZE
    seq64 = seq.to(tl.int64)
    table_row = block_tables_ptr + seq64 * stride_bt
    tok0 = start + tl.arange(0, TILE)  # the partition's first tile
    if PRELOAD_KV:  # read before the wait: see the docstring
        seq_len = tl.load(seq_lens_ptr + seq)
        end0 = tl.minimum(start + PARTITION_SIZE, seq_len)
        offs0 = kv_tile_offsets(table_row, start, end0, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, TILE)
        k_pre, v_pre = load_kv_tile(k_cache_ptr, v_cache_ptr, offs0, tok0 < tl.minimum(end0, seq_len - 1), KV_COLS)
    wait_for_previous_kernel(USE_PDL)
    if not PRELOAD_KV:
        seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g  # (GROUP_PAD,) query heads of this KV group
    out_offs = seq64 * stride_ob + heads[:, None] * stride_oh + d[None, :]  # (GROUP_PAD, D)
    kv_start = window_start(seq_len, WINDOW)  # the first key the query sees
    if seq_len == 0:
        if part == 0:  # padding row: finite zeros, no KV read
            zeros = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + out_offs, zeros, mask=g_mask[:, None])
    elif is_live_partition(start, seq_len, kv_start, PARTITION_SIZE, WINDOW):
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
        q = tl.load(q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None])
        if Q_FP16:
            q = q.to(tl.float16)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        if EO:
            q_lo, q_hi = tl.split(tl.reshape(q, (GROUP_PAD, HEAD_DIM // 2, 2)))  # even, odd columns
            acc_lo = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
            acc_hi = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
        if KQ:
            acct = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
            if not K_E4M3:
                qt = tl.trans(q)
            elif UPCAST_DOT:  # the interpreter's float32 -> e4m3 cast is wrong: the bits computed instead
                qt = tl.trans(e4m3_bits(q.to(tl.float32)).to(tl.float8e4nv, bitcast=True))
            else:
                qt = tl.trans(q.to(tl.float32).to(tl.float8e4nv))
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
        lo = start  # the first tile read: the partition's, or under a window the one holding kv_start
        if WINDOW is not None:  # (a multiple of TILE, as start: the tile offsets stay vectorised)
            lo = tl.multiple_of(tl.maximum(start, kv_start // TILE * TILE), TILE)
        first = kv_tile_offsets(table_row, lo, end, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, TILE)
        loop_start = lo
        offs = first
        if PRELOAD_KV:  # the first tile is peeled (below): the loop starts at the second
            loop_start = start + TILE
            offs = next_tile_offsets(
                table_row, first, start, loop_start, end, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                PARTITION_SIZE, TILE,
            )  # fmt: skip
        mask = loop_start + tl.arange(0, TILE) < end  # (TILE,) tokens of the loop's first tile inside the partition
        if WINDOW is not None:  # (only the first tile can hold tokens before the window)
            mask = mask & (loop_start + tl.arange(0, TILE) >= kv_start)
        if PREFETCH:  # register double buffer: tile i+1's loads are in flight while tile i is consumed
            k_next, v_next = load_kv_tile(k_cache_ptr, v_cache_ptr, offs, mask, KV_COLS)
        if PRELOAD_KV:  # the first tile: this step's token (stored by the kernel before) patched into the preload
            fresh = tok0 == seq_len - 1
            k_new, v_new = load_kv_tile(k_cache_ptr, v_cache_ptr, first, fresh, KV_COLS)
            # (k0 / v0: the loop's k / v keep one type, and under KQ an FP8 tile stays e4m3 here)
            k0 = tl.where(fresh[:, None], k_new, k_pre)
            v0 = tl.where(fresh[:, None], v_new, v_pre)
            if KQ:
                m, l, acct = attend_tile_kq(
                    qt, k0, v0, (tok0 < end)[:, None], m, l, acct, scale_log2, Q_FP16, DOT_PRECISION, UPCAST_DOT,
                    KV_FP8, K_E4M3,
                )  # fmt: skip
            elif EO:
                m, l, acc_lo, acc_hi = attend_tile_eo(
                    q_lo, q_hi, k0, v0, (tok0 < end)[None, :], m, l, acc_lo, acc_hi, scale_log2, DOT_PRECISION,
                    UPCAST_DOT,
                )  # fmt: skip
            else:
                m, l, acc = attend_tile(
                    q, k0.to(q.dtype), v0.to(q.dtype), (tok0 < end)[None, :], m, l, acc, scale_log2, True, USE_DOT,
                    DOT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
        for t0 in range(loop_start, end, TILE):
            tok_mask = mask
            if PREFETCH:
                k, v = k_next, v_next
            else:
                k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, offs, mask, KV_COLS)
            if not KQ and not EO:
                if V_WIDE:  # V widened in the layout it was read in (then staged as float16 for the product)
                    k, v = k.to(q.dtype), widen_e4m3(v, not UPCAST_DOT)
                else:
                    k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 -> q's dtype is exact; a no-op for other caches
            # Next tile's slots, looked up now so the block-table read overlaps this tile's loads and math.
            offs = next_tile_offsets(
                table_row, first, lo, t0 + TILE, end, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                PARTITION_SIZE, TILE,
            )  # fmt: skip
            mask = t0 + TILE + tl.arange(0, TILE) < end
            if PREFETCH:
                k_next, v_next = load_kv_tile(k_cache_ptr, v_cache_ptr, offs, mask, KV_COLS)
            if KQ:
                m, l, acct = attend_tile_kq(
                    qt, k, v, tok_mask[:, None], m, l, acct, scale_log2, Q_FP16, DOT_PRECISION, UPCAST_DOT, KV_FP8,
                    K_E4M3,
                )  # fmt: skip
            elif EO:
                m, l, acc_lo, acc_hi = attend_tile_eo(
                    q_lo, q_hi, k, v, tok_mask[None, :], m, l, acc_lo, acc_hi, scale_log2, DOT_PRECISION, UPCAST_DOT
                )
            else:
                m, l, acc = attend_tile(
                    q, k, v, tok_mask[None, :], m, l, acc, scale_log2, True, USE_DOT, DOT_PRECISION, UPCAST_DOT
                )
        if KQ:
            acc = tl.trans(acct)
        if EO:
            acc = tl.reshape(tl.join(acc_lo, acc_hi), (GROUP_PAD, HEAD_DIM))  # columns 2j, 2j + 1 back in place
        o = acc / l[:, None]  # (GROUP_PAD, D)
        if KV_FP8:  # the reduce is linear in each partial output, so scaling them here scales the result
            o = o * tl.load(v_scale_ptr + kv_head)
        first_live = kv_start // PARTITION_SIZE  # live partitions: first_live .. first_live + num_live - 1
        num_live = tl.cdiv(seq_len, PARTITION_SIZE) - first_live
        if num_live == 1:  # the only live partition: final output
            tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            slot = (seq64 * num_heads + heads) * num_parts + part  # (GROUP_PAD,) row of the workspace
            tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=g_mask[:, None])
            tl.store(part_lse_ptr + slot, m + tl.log2(l), mask=g_mask)
            if FUSED_REDUCE:
                tl.debug_barrier()  # every thread's partial is stored before the program's one atomic
                done = tl.atomic_add(counter_ptr + seq64 * num_kv_heads + kv_head, 1, sem="acq_rel")
                if done == num_live - 1:  # the last live partition of this (sequence, KV head) to finish
                    merge_partitions(
                        out_ptr, part_out_ptr, part_lse_ptr, seq64, kv_head, first_live, num_live, stride_ob,
                        stride_oh, num_heads, num_parts, HEAD_DIM, GROUP, MERGE_GROUP, MERGE_CHUNK,
                    )  # fmt: skip
                    tl.atomic_xchg(counter_ptr + seq64 * num_kv_heads + kv_head, 0)


@triton.jit
def _decode_pairs_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_scale_ptr, v_scale_ptr, counter_ptr, scale_log2,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
    num_heads, num_kv_heads, num_parts,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    Q_FP16: tl.constexpr, FUSED_REDUCE: tl.constexpr, MERGE_GROUP: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = None,
):  # fmt: skip
    """``_decode_partition_kernel`` (FP8 caches, "dot", no prefetch) for the two KV heads 2 program_id(0) and
    2 program_id(0) + 1 of one sequence and partition: each tile is read as (2, TILE, D), the two heads' slices
    of a token row being neighbours in memory (2 x D contiguous bytes), and both heads are attended with batched
    products ((2, G, D) x (2, D, TILE)). Split partials are merged as there, the pair counting in on the
    counter of its first head and the last partition merging both heads. WINDOW: a sliding window, as there."""
    pair = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    wait_for_previous_kernel(USE_PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    i = tl.arange(0, 2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    kv_heads = 2 * pair + i  # (2,)
    heads = kv_heads[:, None] * GROUP + g[None, :]  # (2, GROUP_PAD)
    h_mask = (g[None, :] < GROUP) & (i[:, None] < 2)  # (2, GROUP_PAD)
    seq64 = seq.to(tl.int64)
    out_offs = seq64 * stride_ob + heads[:, :, None] * stride_oh + d[None, None, :]  # (2, GROUP_PAD, D)
    kv_start = window_start(seq_len, WINDOW)  # the first key the query sees
    if seq_len == 0:
        if part == 0:  # padding row: finite zeros, no KV read
            zeros = tl.zeros([2, GROUP_PAD, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + out_offs, zeros, mask=h_mask[:, :, None])
    elif is_live_partition(start, seq_len, kv_start, PARTITION_SIZE, WINDOW):
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
        q = tl.load(
            q_ptr + seq64 * stride_qb + heads[:, :, None] * stride_qh + d[None, None, :],
            mask=h_mask[:, :, None],
            other=0.0,
        )  # (2, GROUP_PAD, D)
        if Q_FP16:
            q = q.to(tl.float16)
        scale_2 = scale_log2 * tl.load(k_scale_ptr + kv_heads)  # (2,)
        table_row = block_tables_ptr + seq64 * stride_bt
        m = tl.full([2, GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([2, GROUP_PAD], tl.float32)
        acc = tl.zeros([2, GROUP_PAD, HEAD_DIM], tl.float32)
        slice_offs = i[:, None, None] * stride_ch + d[None, None, :]  # (2, 1, D) within a token row
        lo = start  # the first tile read: the partition's, or under a window the one holding kv_start
        if WINDOW is not None:
            lo = tl.maximum(start, kv_start // TILE * TILE)
        for t0 in range(lo, end, TILE):
            offs = kv_tile_offsets(table_row, t0, end, 2 * pair, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, TILE)
            mask = t0 + tl.arange(0, TILE) < end  # (TILE,)
            if WINDOW is not None:
                mask = mask & (t0 + tl.arange(0, TILE) >= kv_start)
            ptrs = offs[None, :, None] + slice_offs  # (2, TILE, D)
            k = tl.load(k_cache_ptr + ptrs, mask=mask[None, :, None], other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + ptrs, mask=mask[None, :, None], other=0.0).to(q.dtype)
            s = dot(q, tl.trans(k, (0, 2, 1)), DOT_PRECISION, UPCAST_DOT) * scale_2[:, None, None]  # (2, G, TILE)
            s = tl.where(mask[None, None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=2))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, :, None])
            l = l * alpha + tl.sum(p, axis=2)
            acc = acc * alpha[:, :, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
            m = m_new
        o = acc / l[:, :, None] * tl.load(v_scale_ptr + kv_heads)[:, None, None]  # (2, GROUP_PAD, D)
        first_live = kv_start // PARTITION_SIZE  # live partitions: first_live .. first_live + num_live - 1
        num_live = tl.cdiv(seq_len, PARTITION_SIZE) - first_live
        if num_live == 1:  # the only live partition: final output
            tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, :, None])
        else:
            slot = (seq64 * num_heads + heads) * num_parts + part  # (2, GROUP_PAD)
            tl.store(part_out_ptr + slot[:, :, None] * HEAD_DIM + d[None, None, :], o, mask=h_mask[:, :, None])
            tl.store(part_lse_ptr + slot, m + tl.log2(l), mask=h_mask)
            if FUSED_REDUCE:
                tl.debug_barrier()  # every thread's partials are stored before the program's one atomic
                counter = counter_ptr + seq64 * num_kv_heads + 2 * pair
                done = tl.atomic_add(counter, 1, sem="acq_rel")
                if done == num_live - 1:  # the last live partition of this (sequence, KV head pair)
                    for h in tl.static_range(2):
                        merge_partitions(
                            out_ptr, part_out_ptr, part_lse_ptr, seq64, 2 * pair + h, first_live, num_live,
                            stride_ob, stride_oh, num_heads, num_parts, HEAD_DIM, GROUP, MERGE_GROUP, MERGE_CHUNK,
                        )  # fmt: skip
                    tl.atomic_xchg(counter, 0)


@triton.jit
def merge_partitions(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq64,
    kv_head,
    first_live,
    num_live,
    stride_ob,
    stride_oh,
    num_heads,
    num_parts,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    MERGE_GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Merge the num_live partials (partitions first_live ..; 0 but under a sliding window) of the G query heads of
    (sequence, KV head) by log-sum-exp into out.

    MERGE_GROUP: G padded to a power of two; CHUNK partitions are read per step ((MERGE_GROUP, CHUNK, D) values).
    The partials were written by other programs: they are read with ".cg" (from L2, never a stale L1 line).
    """
    g = tl.arange(0, MERGE_GROUP)
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # (MERGE_GROUP,)
    base = (seq64 * num_heads + heads) * num_parts + first_live  # (MERGE_GROUP,) first live workspace row a head
    # One pass with a running max (one round trip to L2 when the partials fit a chunk): m starts finite, so a
    # padded head (every weight 0) rescales by exp2(0) = 1 and stays NaN-free.
    m = tl.full([MERGE_GROUP], _MERGE_M0, tl.float32)
    l_vec = tl.zeros([MERGE_GROUP, CHUNK], tl.float32)
    acc = tl.zeros([MERGE_GROUP, HEAD_DIM], tl.float32)
    for c0 in range(0, num_live, CHUNK):
        ok = g_ok[:, None] & (c0 + c < num_live)[None, :]  # (MERGE_GROUP, CHUNK)
        rows = base[:, None] + c0 + c[None, :]
        lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            part_out_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # (MERGE_GROUP, CHUNK, D)
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        alpha = tl.exp2(m - m_new)  # (MERGE_GROUP,)
        w = tl.exp2(lse - m_new[:, None])  # (MERGE_GROUP, CHUNK), 0 where not live
        l_vec = l_vec * alpha[:, None] + w
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new
    l_sum = tl.sum(l_vec, axis=1)
    out = acc / tl.where(g_ok, l_sum, 1.0)[:, None]
    out_offs = seq64 * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_parts,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr = None,
):
    """Merge the live partitions of (sequence program_id(0), query head program_id(1)) by log-sum-exp (under a
    sliding WINDOW those from the one holding its first key)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    wait_for_previous_kernel(USE_PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_live = window_start(seq_len, WINDOW) // PARTITION_SIZE
    num_live = tl.cdiv(seq_len, PARTITION_SIZE) - first_live
    if num_live > 1:  # otherwise the partition kernel wrote the output
        base = (seq.to(tl.int64) * num_heads + head) * num_parts + first_live
        c = tl.arange(0, CHUNK)
        d = tl.arange(0, HEAD_DIM)
        m = tl.full([], _MERGE_M0, tl.float32)  # one pass with a running max (see ``merge_partitions``)
        l_vec = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for c0 in range(0, num_live, CHUNK):
            live = c0 + c < num_live
            lse = tl.load(part_lse_ptr + base + c0 + c, mask=live, other=float("-inf"))
            o = tl.load(part_out_ptr + (base + c0 + c)[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)  # (CHUNK,)
            l_vec = l_vec * alpha + w
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
            m = m_new
        out = acc / tl.sum(l_vec, axis=0)
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    partition_size: int | None = None,
    tile_size: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    gqa_mode: GqaMode | None = None,
    prefetch: bool | None = None,
    heads_inner: bool | None = None,
    fused_reduce: bool | None = None,
    preload_kv: bool | None = None,
    fp8_path: Fp8Path | None = None,
    workspace: DecodeWorkspace | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    seq_order: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of q (B, Hq, D) over the paged caches; returns (B, Hq, D) in q's dtype (into `out`).

    block_tables (B, max_blocks) int32, seq_lens (B,) int32 (context length including this step's token; 0
    marks a padding row, which gets zeros). Knobs left None come from DEFAULT_DECODE_CONFIG (FP8 caches:
    DEFAULT_FP8_DECODE_CONFIG), except the partition size, which ``auto_partition_size`` picks from the shapes;
    small batches with a measured entry take theirs (``small_batch_config``, for q's GPU model); a head wider
    than 128 takes a proportionally narrower tile unless ``tile_size`` is given (``tile_for_head_dim``).
    `workspace` (see make_decode_workspace) is allocated here when omitted and more than one partition exists.
    FP8 (float8_e4m3fn) caches need k_scale and v_scale, (Hkv,) float32. seq_order: (B,) int32, the batch's
    sequences longest first (any permutation of range(B) gives the same output), which the launch follows where
    ``orders_longest_first`` says it pays. window: a sliding window in tokens (the query at seq_len - 1 sees keys
    seq_len - window .. seq_len - 1; partitions and tiles before them are not read), a compile-time constant of the
    launch, None for full attention; it turns ``preload_kv`` off (an explicit preload_kv=True is a ValueError).
    Reads no device values, so it can be captured in a CUDA graph.
    """
    base = DEFAULT_FP8_DECODE_CONFIG if is_fp8(k_cache) else DEFAULT_DECODE_CONFIG
    max_context = block_tables.shape[1] * k_cache.shape[1]
    gpu = gpu_model(q.device.index or 0) if q.is_cuda and DEVICE_SHORT_CONFIGS else None
    measured = small_batch_config(q.shape[0], max_context, is_fp8(k_cache), gpu)
    if measured is not None:  # the measured small-batch knobs stand in for the defaults and the auto rules
        base = measured
        partition_size = partition_size or measured.partition_size
        fused_reduce = measured.fused_reduce if fused_reduce is None else fused_reduce
    if partition_size is None:  # by shape, and never shorter than one tile
        auto = auto_partition_size(q.shape[0], k_cache.shape[2], max_context)
        partition_size = max(auto, tile_size or base.tile_size)
    cfg = _resolve_config(
        base,
        partition_size=partition_size,
        tile_size=tile_size,
        num_warps=num_warps,
        num_stages=num_stages,
        gqa_mode=gqa_mode,
        prefetch=prefetch,
        heads_inner=heads_inner,
        fused_reduce=fused_reduce,
        preload_kv=preload_kv,
        fp8_path=fp8_path,
    )
    if cfg.fused_reduce is None:
        cfg = dataclasses.replace(cfg, fused_reduce=fuses_reduce(q.shape[0], k_cache.shape[2]))
    narrowed = cfg.tile_size if tile_size is not None else tile_for_head_dim(cfg.tile_size, q.shape[2])
    if narrowed != cfg.tile_size:  # a knob set's tile was tuned at head_dim 128: a wider head takes a narrower one
        cfg = dataclasses.replace(cfg, tile_size=narrowed)  # (no copy on the hot path of heads of <= 128)
    check_window(window)
    if window is not None and preload_kv:
        raise ValueError("preload_kv reads each partition's first tile, not a sliding window's: pass window=None")
    if window is not None:  # (a measured config's preload is a speed knob: dropped)
        cfg = dataclasses.replace(cfg, preload_kv=False)
    _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out, cfg)
    check_scale(scale)
    check_kv_scales(k_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    num_parts = num_decode_partitions(block_tables, block_size, cfg.partition_size)
    if num_parts == 1:
        workspace = None  # every sequence fits one partition: no partials, no reduce
    elif workspace is None:
        workspace = make_decode_workspace(q, block_tables, block_size, cfg.partition_size)
    else:
        _check_workspace(workspace, q, num_parts)
    if num_seqs == 0:
        return out
    kv = KVCache(k_cache, v_cache, k_scale, v_scale)
    if kv.k_scale is not None and cfg.fp8_path == "wgmma_qk8" and head_dim < 32:  # (Triton's rule for e4m3 dots)
        raise ValueError(f"fp8_path 'wgmma_qk8' needs head_dim >= 32 (its e4m3 product is 32 deep), got {head_dim}")
    if kv.k_scale is not None and cfg.fp8_path == "mma_pairs":
        _launch_pairs(q, kv, block_tables, seq_lens, scale, out, workspace, num_parts, cfg, window)
    else:
        ordered = seq_order is not None and orders_longest_first(num_seqs, k_cache.shape[2], num_parts, kv)
        if ordered and (seq_order.shape != (num_seqs,) or seq_order.dtype != torch.int32):
            raise ValueError(f"seq_order must be ({num_seqs},) int32, got {seq_order.dtype} {tuple(seq_order.shape)}")
        order = seq_order if ordered else None
        _launch_partitions(q, kv, block_tables, seq_lens, scale, out, workspace, num_parts, cfg, order, window)
    if workspace is not None and not cfg.fused_reduce:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            workspace.partial_out,
            workspace.partial_lse,
            seq_lens,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_parts,
            HEAD_DIM=head_dim,
            PARTITION_SIZE=cfg.partition_size,
            CHUNK=_REDUCE_CHUNK,
            USE_PDL=use_pdl(q.device),
            WINDOW=window,
            num_warps=4 if head_dim >= 128 else 2,
            **pdl_launch(q.device),
        )
    return out


def _split_outputs(
    q: torch.Tensor,
    kv: KVCache,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspace | None,
    cfg: DecodeKernelConfig,
) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]:
    """(partial outputs, partial LSEs, whether the last partition merges them, its arrival counters) of a split
    launch. Without a workspace (P == 1) the kernel never takes its partial branch, so any tensor fills the
    slots: ``out`` for the partials, ``seq_lens`` for the counters."""
    part_out, part_lse = workspace if workspace is not None else (out, out)
    fused = workspace is not None and bool(cfg.fused_reduce)
    counters = split_counters(q.device, q.shape[0] * kv.k.shape[2]) if fused else seq_lens
    return part_out, part_lse, fused, counters


def _launch_partitions(
    q: torch.Tensor,
    kv: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: DecodeWorkspace | None,
    num_parts: int,
    cfg: DecodeKernelConfig,
    seq_order: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """Launch the split-K partition kernel on grid (Hkv, B, P), or (B, Hkv, P) when not cfg.heads_inner; with
    ``seq_order`` ((B,) int32, a permutation of the batch) the grid's sequence index r serves seq_order[r]; under a
    sliding ``window`` of tokens (None: full attention)."""
    num_seqs, num_heads, head_dim = q.shape
    k_cache, v_cache = kv.k, kv.v
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    part_out, part_lse, fused, counters = _split_outputs(q, kv, seq_lens, out, workspace, cfg)
    merge_group = int(triton.next_power_of_2(group))
    k_e4m3 = kv.k_scale is not None and cfg.fp8_path == "wgmma_qk8"  # the transposed products, K as stored
    kq = k_e4m3 or cfg.gqa_mode == "kq"
    q_fp16 = fp8_compute_fp16(q, kv.k)  # (an FP8 cache and 16-bit q)
    eo = q_fp16 and cfg.fp8_path == "mma_eo" and cfg.gqa_mode == "dot" and head_dim >= 32
    if eo:  # the caches read as int16 pairs of e4m3 bytes (strides below in int16 elements)
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
    grid = (num_kv_heads, num_seqs, num_parts) if cfg.heads_inner else (num_seqs, num_kv_heads, num_parts)
    _decode_partition_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        seq_lens if kv.k_scale is None else kv.k_scale,  # any pointer where the kernel reads no scale
        seq_lens if kv.v_scale is None else kv.v_scale,
        counters,
        seq_lens if seq_order is None else seq_order,  # any pointer where the kernel reads no order
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        num_kv_heads,
        num_parts,
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_PAD=_group_pad(group, cfg.gqa_mode, kq),
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=cfg.partition_size,
        TILE=cfg.tile_size,
        USE_DOT=cfg.gqa_mode != "sum",
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.device),
        PREFETCH=cfg.prefetch,
        HEADS_INNER=cfg.heads_inner,
        KV_FP8=kv.k_scale is not None,
        Q_FP16=q_fp16,
        KQ=kq,
        FUSED_REDUCE=fused,
        MERGE_GROUP=merge_group,
        MERGE_CHUNK=max(1, _MERGE_ELEMENTS // (merge_group * head_dim)),
        USE_PDL=use_pdl(q.device),
        PRELOAD_KV=cfg.preload_kv,
        ORDERED=seq_order is not None,
        V_WIDE=q_fp16 and cfg.fp8_path == "mma_v16",
        K_E4M3=k_e4m3,
        EO=eo,
        WINDOW=window,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(q.device),
    )


def _launch_pairs(
    q: torch.Tensor,
    kv: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: DecodeWorkspace | None,
    num_parts: int,
    cfg: DecodeKernelConfig,
    window: int | None = None,
) -> None:
    """Launch ``_decode_pairs_kernel`` (FP8 caches, fp8_path "mma_pairs") on grid (Hkv / 2, B, P), under a sliding
    ``window`` of tokens (None: full attention)."""
    num_seqs, num_heads, head_dim = q.shape
    k_cache, v_cache = kv.k, kv.v
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_kv_heads % 2:
        raise ValueError(f"fp8_path 'mma_pairs' needs an even number of KV heads, got {num_kv_heads}")
    group = num_heads // num_kv_heads
    part_out, part_lse, fused, counters = _split_outputs(q, kv, seq_lens, out, workspace, cfg)
    merge_group = int(triton.next_power_of_2(group))
    _decode_pairs_kernel[(num_kv_heads // 2, num_seqs, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, kv.k_scale, kv.v_scale, counters,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads, num_kv_heads, num_parts,
        HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=_group_pad(group, "dot"), BLOCK_SIZE=block_size,
        PARTITION_SIZE=cfg.partition_size, TILE=cfg.tile_size, DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.device), Q_FP16=fp8_compute_fp16(q, k_cache), FUSED_REDUCE=fused,
        MERGE_GROUP=merge_group, MERGE_CHUNK=max(1, _MERGE_ELEMENTS // (merge_group * head_dim)),
        USE_PDL=use_pdl(q.device), WINDOW=window, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(q.device),
    )  # fmt: skip


def fp8_compute_fp16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels multiply an FP8 cache's tiles in float16 (q converted to it): for 16-bit q.

    Why float16 and not q's bfloat16: on sm_90 Triton widens e4m3 to float16 with one packed conversion
    (cvt.rn.f16x2.e4m3x2, two values) but to bfloat16 with three (that one, then two cvt.bf16.f16), and
    conversions issue at a fraction of the ALU rate; a decode step at B=256 widens ~560 M values. Both are
    exact for e4m3, and q (O(10) after the norms) converts exactly from bfloat16 while |q| <= 65504. float32 q
    (the CPU tests) keeps float32.
    """
    return is_fp8(k_cache) and q.dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact "ieee" for float32 inputs (tf32 would cost ~1e-3), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(device: torch.device) -> bool:
    """Whether kernels must widen dot operands to float32: only off CUDA, i.e. under the Triton interpreter."""
    return device.type != "cuda"


def _group_pad(group: int, gqa_mode: GqaMode, kq: bool = False) -> int:
    """Rows the G query heads of a KV group are padded to: >= 16 for tl.dot, a power of two >= 2 for tl.sum, >= 8
    for the transposed products (gqa_mode "kq", fp8_path "wgmma_qk8": the heads are the products' N, which may be 8)."""
    return max(8 if kq else 16 if gqa_mode == "dot" else 2, int(triton.next_power_of_2(group)))


def _resolve_config(base: DecodeKernelConfig, **knobs: object) -> DecodeKernelConfig:
    """``base`` with the knobs that are not None replaced; the tile shrinks to fit the partition."""
    given = {name: value for name, value in knobs.items() if value is not None}
    cfg = dataclasses.replace(base, **given)  # type: ignore[arg-type]
    if "tile_size" not in given:
        cfg = dataclasses.replace(cfg, tile_size=min(cfg.tile_size, cfg.partition_size))
    return cfg


def _is_pow2(n: int) -> bool:
    """True when n is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def _check_config(cfg: DecodeKernelConfig) -> None:
    """Raise ValueError naming the knob when the launch configuration is unusable."""
    if cfg.gqa_mode not in ("dot", "sum", "kq"):
        raise ValueError(f"gqa_mode must be 'dot', 'sum' or 'kq', got {cfg.gqa_mode!r}")
    if cfg.fp8_path not in FP8_PATHS or (cfg.fp8_path not in ("mma", "mma_eo") and cfg.gqa_mode != "dot"):
        raise ValueError(
            f"fp8_path must be one of {FP8_PATHS} ('mma' or 'mma_eo' unless gqa_mode is 'dot'), got {cfg.fp8_path!r}"
        )
    if cfg.preload_kv and cfg.fp8_path not in ("mma", "mma_v16", "mma_eo"):  # none in "mma_pairs"; qk8 untested
        raise ValueError(f"preload_kv needs fp8_path 'mma', 'mma_v16' or 'mma_eo', got {cfg.fp8_path!r}")
    if not _is_pow2(cfg.partition_size):
        raise ValueError(f"partition_size must be a power of two, got {cfg.partition_size}")
    min_tile = 1 if cfg.gqa_mode == "sum" else 16
    if not (_is_pow2(cfg.tile_size) and cfg.tile_size >= min_tile):
        raise ValueError(f"tile_size must be a power of two >= {min_tile} for {cfg.gqa_mode!r}, got {cfg.tile_size}")
    if cfg.partition_size < cfg.tile_size:
        raise ValueError(f"partition_size {cfg.partition_size} must be >= tile_size {cfg.tile_size}")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(
            f"num_warps must be 1..16 (power of two), num_stages >= 1; got {cfg.num_warps}, {cfg.num_stages}"
        )


def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    cfg: DecodeKernelConfig,
) -> None:
    """Raise ValueError naming the argument when shapes, dtypes or layouts do not fit (reads no values)."""
    _check_config(cfg)
    check_paged_qkv(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be ({num_seqs}, max_blocks) int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens must be contiguous ({num_seqs},) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    check_out(out, q)


def check_paged_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError unless q (N, Hq, D) and the contiguous caches (num_blocks, block_size, Hkv, D) fit."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q (N, Hq, D) and caches (num_blocks, block_size, Hkv, D), got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not fit cache heads/dim {tuple(k_cache.shape[2:])}")
    if not (_is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    cache_ok = k_cache.dtype == v_cache.dtype and (k_cache.dtype == q.dtype or is_fp8(k_cache))
    if not cache_ok or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q must be fp16/bf16/fp32 and both caches q's dtype or float8_e4m3fn, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if q.stride(2) != 1:
        raise ValueError(f"q needs a contiguous last dim, got strides {q.stride()}")
    check_same_layout(k_cache, v_cache)  # either memory order: the kernels take the caches' strides


def check_scale(scale: float) -> None:
    """Raise ValueError unless the softmax scale is a finite number > 0 (``attend_tile`` scales the row max, not
    each score, which only a positive scale allows)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    """Raise ValueError unless `out` is None or a tensor like q (shape, dtype, device) with a contiguous last dim."""
    if out is None:
        return
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _check_workspace(workspace: DecodeWorkspace, q: torch.Tensor, num_parts: int) -> None:
    """Raise ValueError unless the workspace is float32, contiguous and (B, Hq, >= P, D) / (B, Hq, >= P)."""
    num_seqs, num_heads, head_dim = q.shape
    part_out, part_lse = workspace
    want_out = (num_seqs, num_heads, num_parts, head_dim)
    want_lse = (num_seqs, num_heads, num_parts)
    if tuple(part_out.shape) != want_out or tuple(part_lse.shape) != want_lse:
        raise ValueError(
            f"workspace must be partial_out {want_out} and partial_lse {want_lse}, got {tuple(part_out.shape)} "
            f"and {tuple(part_lse.shape)}"
        )
    if part_out.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError(f"workspace must be float32, got {part_out.dtype} and {part_lse.dtype}")
    if not (part_out.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError("workspace tensors must be contiguous")
