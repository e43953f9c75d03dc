"""An H200 stand-in on an H100: run a benchmark on fewer SMs with the whole DRAM (a CUDA green context).

The H200 brings 1.35 times the H100's DRAM bandwidth to the same 132 SMs, so a kernel bound by the instructions
it spends a byte is held back on an H200 where the H100 still reads at full speed. An H100 given 88-96 SMs has
the H200's bytes per SM: there the FP8 decode kernel of the twenty-sixth session sat as far behind a plain read
of its bytes as on an H200 (0.81-0.85 against 0.83; the bf16 kernel at 0.98 on both; BENCHMARKS.md, twenty-ninth
session). Kernels bound by launch latency (short GEMMs) do not change with the SM count, and the stand-in says
nothing about them.

    from benchmarks.green import limit_sms
    green = limit_sms(88)  # keep the context alive; everything after runs on 88 SMs

``bench_fp8_kv.py --sms N`` and ``bench_fp8_gemm.py --sms N`` call it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sm_id_kernel(out_ptr, SPIN: tl.constexpr):
    """out[pid] = the SM program pid ran on, after SPIN dependent float ops (so the grid spreads over the SMs)."""
    pid = tl.program_id(0)
    zero = tl.full([1], 0, tl.int32)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32, is_pure=False, pack=1)
    acc = pid.to(tl.float32)
    for _ in range(SPIN):
        acc = acc * 1.0000001 + 1e-7
    tl.store(out_ptr + pid + tl.arange(0, 1), sm + (acc > 1e30).to(tl.int32))  # (acc: kept, never true)


def sms_used(graph: bool) -> int:
    """Distinct SMs that 4 x 132 spinning programs ran on, launched eagerly or replayed from a CUDA graph."""
    out = torch.full((4 * 132,), -1, dtype=torch.int32, device="cuda")
    launch = lambda: _sm_id_kernel[(out.shape[0],)](out, SPIN=20000)  # noqa: E731
    launch()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        out.fill_(-1)
        g.replay()
    torch.cuda.synchronize()
    return len(set(out.tolist()))


def limit_sms(num_sms: int) -> object:
    """Make a CUDA green context of num_sms SMs current for the rest of the process (its default stream becomes
    torch's current stream), after checking that eager launches and graph replays stay on num_sms SMs; returns
    the context (keep it alive). SystemExit with the reason where that cannot be done."""
    if not torch.cuda.is_available():
        raise SystemExit("--sms needs a CUDA GPU (a green context partitions its SMs)")
    from torch.cuda.green_contexts import GreenContext

    torch.zeros(1, device="cuda")  # the primary context first
    try:
        ctx = GreenContext.create(num_sms=num_sms)
    except TypeError:  # torch 2.9-2.10: create(num_sms, device_id)
        ctx = GreenContext.create(num_sms, 0)
    (getattr(ctx, "set_context", None) or ctx.make_current)()
    eager, graph = sms_used(False), sms_used(True)
    print(f"green context of {num_sms} SMs: kernels ran on {eager} SMs eagerly, {graph} from a CUDA graph", flush=True)
    if max(eager, graph) > num_sms:
        raise SystemExit(f"--sms {num_sms}: kernels ran on {max(eager, graph)} SMs; the green context does not hold")
    return ctx
