"""benchmarks/sass_count.py's reading of SASS: opcodes with their modifiers, the tile loop as the longest stretch a
branch jumps back over, programs an SM from registers and shared memory, and the constexprs it compiles with against
the launcher's (the compile itself runs in test_benchmarks_smoke.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import sass_count
from fnvllm.kernels import decode_attention as dec

# nvdisasm -c lines (address comment, instruction, encoding comment), two loops: a short one, then a longer one
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                  /* 0x000 */
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;                                 /* 0x000 */
        /*0020*/              @!P0 BRA `(.L_x_0) ;                                         /* 0x000 */
.L_x_1:
        /*0030*/                   LDS.U8 R3, [R4] ;                                       /* 0x000 */
        /*0040*/                   LDS.U8 R5, [R4+0x1] ;                                   /* 0x000 */
        /*0050*/                   F2FP.F16.E4M3.UNPACK_B R6, R3 ;                         /* 0x000 */
        /*0060*/                   HMMA.16816.F32 R8, R10, R12, R8 ;                       /* 0x000 */
        /*0070*/               @P1 BRA `(.L_x_1) ;                                         /* 0x000 */
        /*0080*/                   EXIT ;                                                  /* 0x000 */
"""


def test_the_longest_backward_branch_is_the_tile_loop_and_opcodes_keep_their_modifiers() -> None:
    lines = sass_count.parse_sass(SASS)
    assert lines[0] == "MOV R1, c[0x0][0x28]" and ".L_x_1:" in lines
    loop = sass_count.longest_loop(lines)
    assert loop[0] == ".L_x_1:" and loop[-1] == "@P1 BRA `(.L_x_1)"
    counts = sass_count.opcodes(loop)
    assert counts == {"LDS.U8": 2, "F2FP.F16.E4M3.UNPACK_B": 1, "HMMA.16816.F32": 1, "BRA": 1}
    assert sass_count.opcodes(lines)["IADD3"] == 1 and sum(sass_count.opcodes(lines).values()) == 9


def test_programs_an_sm_take_the_tighter_of_registers_and_shared_memory() -> None:
    # the shipped FP8 decode knobs: 168 registers x 128 threads, 72 KiB -> 3 (both limits), as ncu reported
    assert sass_count.programs_per_sm(168, 72 * 1024, 4) == 3
    assert sass_count.programs_per_sm(196, 72 * 1024, 4) == 2  # registers bind
    assert sass_count.programs_per_sm(126, 104 * 1024, 4) == 2  # shared memory binds
    assert sass_count.programs_per_sm(126, 54 * 1024, 4) == 4


class _Recorder:
    """Stands in for the Triton kernel: ``kernel[grid](*args, **kw)`` records kw and launches nothing."""

    def __init__(self) -> None:
        self.constexprs: dict[str, object] = {}

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kw: self.constexprs.update(kw)


@pytest.mark.parametrize(
    "kv,fp8_path,gqa",
    [("bf16", "mma", "dot"), ("bf16", "mma", "kq"), ("fp8", "mma", "dot"), ("fp8", "mma", "kq"),
     ("fp8", "mma_v16", "dot"), ("fp8", "wgmma_qk8", "dot"), ("fp8", "mma_eo", "dot")],
)  # fmt: skip
def test_the_compiled_constexprs_are_the_launchers(
    monkeypatch: pytest.MonkeyPatch, kv: str, fp8_path: str, gqa: str
) -> None:
    """The knob-dependent constexprs the tool compiles with are those ``_launch_partitions`` passes for the same
    knobs (a bf16 q; the GPU-only ones, such as UPCAST_DOT and USE_PDL, are the tool's by design)."""
    recorder = _Recorder()
    monkeypatch.setattr(dec, "_decode_partition_kernel", recorder)
    group, head_dim, block, tile = 2, 32, 16, 16
    q = torch.zeros(2, 2 * group, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(8, block, 2, head_dim, dtype=torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
    scales = torch.ones(2) if kv == "fp8" else None
    tables, seq_lens = (
        torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32),
        torch.tensor([50, 64], dtype=torch.int32),
    )
    dec.paged_decode_attention(
        q, cache, cache, tables, seq_lens, 1.0, partition_size=32, tile_size=tile, fp8_path=fp8_path, gqa_mode=gqa,
        k_scale=scales, v_scale=scales, fused_reduce=True,
    )  # fmt: skip
    args = argparse.Namespace(
        kv=kv, fp8_path=fp8_path, gqa=gqa, tile=tile, partition=32, group=group, head_dim=head_dim, block=block,
        preload=False,
    )  # fmt: skip
    tool = sass_count.kernel_constexprs(args)
    knob_dependent = ["HEAD_DIM", "GROUP", "GROUP_PAD", "BLOCK_SIZE", "PARTITION_SIZE", "TILE", "USE_DOT", "KV_FP8",
                      "Q_FP16", "KQ", "V_WIDE", "K_E4M3", "EO", "FUSED_REDUCE", "MERGE_GROUP",
                      "MERGE_CHUNK"]  # fmt: skip
    assert {k: tool[k] for k in knob_dependent} == {k: recorder.constexprs[k] for k in knob_dependent}


@pytest.mark.parametrize("kv,gqa", [("fp8", "dot"), ("fp8", "kq"), ("bf16", "kq")])
def test_the_preloaded_first_tile_compiles_for_hopper(kv: str, gqa: str) -> None:
    """The kernel with its first tile read before the wait compiles for sm_90 (Triton's front end refuses a loop
    variable that changes type: an FP8 tile peeled into the loop's k did, found on an H100 on 2026-12-06, which the
    interpreter's tests cannot see). In a process of its own: the script compiles, the interpreter would not."""
    script = Path(sass_count.__file__)
    args = ["--kv", kv, "--gqa", gqa, "--preload", "--tile", "64", "--top", "0"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(script.parents[1])})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "programs an SM" in done.stdout


def test_the_even_odd_fp8_path_compiles_for_hopper_without_byte_loads(tmp_path: Path) -> None:
    """fp8_path "mma_eo" compiles for sm_90 (its PTX and the split / join of even and odd columns, which the
    interpreter's tests never compile), its tile loop reads no single bytes from shared memory (LDS.U8: "mma" reads
    its e4m3 operands byte by byte) and runs under two thirds of "mma"'s instructions (649 against 1,145 a warp per
    128 tokens with Triton 3.9). In a process of its own, as above."""
    script = Path(sass_count.__file__)
    reports = {}
    for path in ("mma", "mma_eo"):
        out = tmp_path / f"{path}.json"
        done = subprocess.run([sys.executable, str(script), "--fp8-path", path, "--top", "0", "--json", str(out)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(script.parents[1])})  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        reports[path] = json.loads(out.read_text())
    assert reports["mma"]["loop_opcodes"].get("LDS.U8", 0) > 0  # the cost "mma_eo" removes is there to remove
    assert reports["mma_eo"]["loop_opcodes"].get("LDS.U8", 0) == 0
    assert reports["mma_eo"]["loop_sass"] < 2 / 3 * reports["mma"]["loop_sass"]
