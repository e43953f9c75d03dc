"""The decode attention kernel compiled for a Hopper GPU on any machine, no GPU needed: registers, shared memory,
programs an SM, and the SASS of its tile loop counted by opcode. A kernel bound by the instructions a tile costs
(the FP8 decode kernel: BENCHMARKS.md, twenty-seventh session) can be worked on from these counts, then timed.

    PYTHONPATH=$PWD python3 benchmarks/sass_count.py [--kv fp8|bf16] [--fp8-path mma] [--gqa dot|kq] [--preload]
        [--tile 128] [--stages 3] [--warps 4] [--partition 512] [--group 2] [--head-dim 128] [--block 256]
        [--top 16] [--json PATH]

Triton compiles ``decode_attention._decode_partition_kernel`` for sm_90 (``triton.compile`` on an ``ASTSource``
with ``GPUTarget("cuda", 90, 32)``) with the constexprs ``_launch_partitions`` would pass for these knobs and a
16-bit q (pointers and strides marked 16-divisible, as Triton specializes them on a GPU: without that hint its
pipeliner stages no loads); its bundled ``nvdisasm`` / ``cuobjdump`` read the cubin. The tile loop is the longest
stretch of code that a branch jumps back to the start of; its count is static (one pass of the loop, per warp),
and the dynamic count is that times the tiles a program walks. The Triton version matters (the GPU machine runs
3.6; 3.9 compiles the same kernel with spills): the script prints it. Checked against the GPU: with Triton 3.6 the
shipped FP8 knobs give 168 registers and 72 KiB of shared memory, as ``ncu`` read on an H100.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before Triton's import: the script compiles kernels, never interprets (an importer keeps
    os.environ.pop("TRITON_INTERPRET", None)  # its own setting)

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fnvllm.kernels import decode_attention as dec

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # bytes a Hopper SM gives its blocks (1 KiB of it reserved per block)
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
OPCODE = re.compile(r"(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+.*`\((\.L_x_\d+)\)")


def kernel_signature(kv_fp8: bool, eo: bool = False) -> dict[str, str]:
    """Triton types of ``_decode_partition_kernel``'s runtime arguments, in order (bf16 q and out; eo: an FP8
    cache passed as its int16 view, fp8_path "mma_eo")."""
    cache = "*i16" if eo else "*fp8e4nv" if kv_fp8 else "*bf16"
    sig = {
        "q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "counter_ptr": "*i32", "order_ptr": "*i32",
        "scale_log2": "fp32",
    }  # fmt: skip
    ints = ["stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_cb", "stride_ct", "stride_ch", "stride_bt",
            "num_heads", "num_kv_heads", "num_parts"]  # fmt: skip
    return {**sig, **dict.fromkeys(ints, "i32")}


def kernel_constexprs(args: argparse.Namespace) -> dict[str, object]:
    """The constexprs ``_launch_partitions`` passes for these knobs, a bf16 q on a GPU and split partitions."""
    fp8 = args.kv == "fp8"
    k_e4m3 = fp8 and args.fp8_path == "wgmma_qk8"
    kq = k_e4m3 or args.gqa == "kq"
    merge_group = int(triton.next_power_of_2(args.group))
    return dict(
        HEAD_DIM=args.head_dim, GROUP=args.group, GROUP_PAD=dec._group_pad(args.group, args.gqa, kq),
        BLOCK_SIZE=args.block, PARTITION_SIZE=args.partition, TILE=args.tile, USE_DOT=args.gqa != "sum",
        DOT_PRECISION="tf32", UPCAST_DOT=False, PREFETCH=False, HEADS_INNER=True, KV_FP8=fp8, Q_FP16=fp8, KQ=kq,
        FUSED_REDUCE=True, MERGE_GROUP=merge_group,
        MERGE_CHUNK=max(1, dec._MERGE_ELEMENTS // (merge_group * args.head_dim)), USE_PDL=True,
        PRELOAD_KV=args.preload, ORDERED=fp8, V_WIDE=fp8 and args.fp8_path == "mma_v16", K_E4M3=k_e4m3,
        EO=fp8 and args.fp8_path == "mma_eo" and args.gqa == "dot" and args.head_dim >= 32,
        WINDOW=getattr(args, "window", None),
    )  # fmt: skip


def compile_kernel(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    """``_decode_partition_kernel`` compiled for sm_90 with these knobs."""
    sig = kernel_signature(args.kv == "fp8", bool(kernel_constexprs(args)["EO"]))
    constexprs = kernel_constexprs(args)
    names = [*sig, *constexprs]
    full = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride_") or n == "num_heads"]
    src = ASTSource(
        dec._decode_partition_kernel,
        full,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": args.warps, "num_stages": args.stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def nvidia_tool(name: str) -> str:
    """A CUDA binary utility shipped with Triton's NVIDIA backend."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_and_registers(cubin: bytes) -> tuple[list[str], int]:
    """(instructions of the cubin's SASS in order, labels kept as ".L_x_N:" lines; registers a thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True)
        usage = subprocess.run(
            [nvidia_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        )
    registers = re.search(r"REG:(\d+)", usage.stdout)
    return parse_sass(sass.stdout), int(registers.group(1)) if registers else 0


def parse_sass(text: str) -> list[str]:
    """nvdisasm's listing as its instructions in order (address and encoding comments dropped), each label kept as
    a ".L_x_N:" line where it stands."""
    lines: list[str] = []
    for line in text.splitlines():
        label = LABEL.match(line)
        if label:
            lines.append(label.group(1) + ":")
        elif (ins := INSTRUCTION.match(line)) is not None:
            lines.append(ins.group(2))
    return lines


def opcodes(lines: list[str]) -> collections.Counter[str]:
    """Instruction count by opcode with its modifiers (LDS.U8, F2FP.F16.E4M3.UNPACK_B, ...), labels skipped."""
    found = (OPCODE.match(line) for line in lines if not line.endswith(":"))
    return collections.Counter(m.group(1) for m in found if m)


def longest_loop(lines: list[str]) -> list[str]:
    """The longest stretch from a label to a branch back to it: the tile loop (the merge loop is shorter)."""
    where: dict[str, int] = {}
    best: list[str] = []
    for i, line in enumerate(lines):
        if line.endswith(":"):
            where[line[:-1]] = i
        elif (b := BRANCH.search(line)) is not None and b.group(1) in where and i - where[b.group(1)] > len(best):
            best = lines[where[b.group(1)] : i + 1]
    return best


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Blocks of this kernel one SM holds, by registers and by shared memory (warps never bind at <= 8 a block)."""
    by_registers = REGISTERS_PER_SM // max(1, registers * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + 1024)
    return min(by_registers, by_shared)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="the cache's dtype (default fp8)")
    parser.add_argument(
        "--fp8-path",
        choices=dec.FP8_PATHS,
        default=dec.FP8_PATH_DEFAULT,
        help="FP8 caches' product path (default: the launcher's)",
    )
    parser.add_argument("--preload", action="store_true", help="preload_kv: the first tile read before the wait")
    parser.add_argument("--gqa", choices=("dot", "kq", "sum"), default="dot", help="gqa_mode (default dot)")
    parser.add_argument("--window", type=int, help="a sliding window in tokens (default: none, full attention)")
    parser.add_argument("--tile", type=int, help="tokens a tile (default: the launcher's default for the dtype)")
    parser.add_argument("--stages", type=int, help="pipeline stages (default: the launcher's default)")
    parser.add_argument("--warps", type=int, help="warps a program (default: the launcher's default)")
    parser.add_argument("--partition", type=int, default=512, help="tokens a partition (default 512)")
    parser.add_argument("--group", type=int, default=2, help="query heads a KV head (default 2: Qwen3-0.6B)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=256, help="tokens a cache block (default 256)")
    parser.add_argument("--top", type=int, default=16, help="opcodes listed (default 16)")
    parser.add_argument("--json", type=Path, help="write the counts here too")
    args = parser.parse_args(argv)
    base = dec.DEFAULT_FP8_DECODE_CONFIG if args.kv == "fp8" else dec.DEFAULT_DECODE_CONFIG
    args.tile = args.tile or base.tile_size
    args.stages = args.stages or base.num_stages
    args.warps = args.warps or base.num_warps
    kernel = compile_kernel(args)
    lines, registers = sass_and_registers(kernel.asm["cubin"])
    loop = longest_loop(lines)
    shared = int(kernel.metadata.shared)
    counts, loop_counts = opcodes(lines), opcodes(loop)
    report = {
        "triton": triton.__version__, "kv": args.kv, "fp8_path": args.fp8_path if args.kv == "fp8" else None,
        "tile": args.tile, "stages": args.stages, "warps": args.warps, "registers": registers, "shared_bytes": shared,
        "programs_per_sm": programs_per_sm(registers, shared, args.warps), "kernel_sass": sum(counts.values()),
        "loop_sass": sum(loop_counts.values()), "loop_opcodes": dict(loop_counts.most_common()),
    }  # fmt: skip
    knobs = f"{args.kv} {report['fp8_path'] or ''} tile {args.tile}, {args.stages} stages, {args.warps} warps"
    print(f"Triton {triton.__version__}, sm_90: {knobs}")
    print(f"  {registers} registers, {shared / 1024:.1f} KiB shared, {report['programs_per_sm']} programs an SM")
    print(f"  {report['kernel_sass']} SASS instructions; the tile loop {report['loop_sass']} a warp per pass:")
    top = loop_counts.most_common(args.top)
    print("   ", ", ".join(f"{op} {n}" for op, n in top))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
