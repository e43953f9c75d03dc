"""The fused-MoE kernel at Qwen3-30B-A3B sizes on one GPU: correctness, decode bandwidth, prefill compute.

    PYTHONPATH=$PWD python3 benchmarks/bench_moe.py [--json PATH] [--budget-s 60] [--no-sweep] [--e2e]

Sizes: hidden 2048, 128 experts of intermediate 768, top-8 of a softmax over random router logits
(renormalised), bf16 weights N(0, 1/fan_in) (1.2 GB of experts a layer, far above the 50 MB L2).

(a) ``fused_moe`` (the shipped launcher, ``pick_config``'s tiles) against ``fused_moe_ref`` at 1, 7, 256 and
    8192 tokens (PASS/FAIL, relative error; tolerance 1e-2);
(b) decode, 256 tokens: TB/s of expert weight bytes actually needed = experts touched x 3 x H x I x 2 bytes
    over the time of one fused_moe call (alignment, both GEMMs and the combine), median of CUDA-graph replays
    under triton.testing.do_bench (which flushes L2 before each). Target >= 3.0 TB/s;
(c) prefill, 8192 tokens: TFLOP/s = 2 x T x K x 3 x H x I over the same time. Target >= 500 TFLOP/s;
    The shipped config is also timed with programmatic dependent launch off (FNVLLM_PDL=0's path);
(d) per-kernel times of the shipped config (and of the sweep's best): alignment, gate_up (TFLOP/s), down
    (TFLOP/s), combine (TB/s of its reads and writes), each alone in its own CUDA graph;
(e) unless --no-sweep: the alignment's programs per launch (each checked equal to the torch path) and the
    combine's columns and warps (each checked bit-equal to the default combine) timed alone; then tile configs for
    both GEMMs (pointer or TMA-descriptor loads, tile sizes, the down kernel's own tiles, persistent programs in
    one kernel or both, atomic combine), most promising first, each checked against the reference before it is
    timed; then the best gate_up, best down, best alignment and best combine combined; the best is printed as
    the MoeKernelConfig to paste into fnvllm/kernels/fused_moe.py's pick_config table;
(f) with --e2e: a tiny fp32 Qwen3-MoE (8 experts, top-2, a dense layer) through ``LLM`` on the GPU (Triton ops,
    CUDA graphs for decode) against transformers' greedy tokens, 24 prompts of 16 tokens (exact equality); it
    takes a minute or more (engine start, graph captures), so it is off by default.
Every line is printed as it is measured. The whole run (checks, benches, sweeps) stays within --budget-s plus the
time of the last config started (~10 s, compiles included): the decode sweep stops at 35 % of the budget, the
prefill sweep at 85 %. The summary tables come last (before --e2e); --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import attrs
import torch
import triton
import triton.testing

from fnvllm.kernels import fused_moe as fm
from fnvllm.kernels.fused_ops import set_pdl, use_pdl
from fnvllm.kernels.reference import route_ref as route

DEV = "cuda"
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DECODE_TOKENS, PREFILL_TOKENS = 256, 8192
C = fm.MoeKernelConfig  # (block_m, block_n, block_k, group_m, num_warps, num_stages, tma, down_block_n,
# down_block_k, down_num_warps, down_num_stages, atomic_combine, persistent). Most promising first: the budget may
# stop a sweep early. Rows vary the gate_up and the down kernel at once; the per-kernel times let the best of each
# be combined (same block_m) at the end.
DECODE_SWEEP = (
    C(32, 64, 64, 1, 4, 5, True),
    C(32, 64, 64, 1, 4, 5, True, persistent=True),
    C(32, 64, 128, 1, 4, 4, False),
    C(16, 64, 128, 1, 4, 4, False, 128, 128),
    C(32, 32, 128, 1, 4, 4, False, 64, 128),
    C(32, 64, 128, 1, 4, 4, True, 128, 64, 4, 5),
    C(32, 64, 64, 4, 4, 5, False),
    C(32, 64, 64, 1, 4, 5, True, fused_gate_up=True),  # last: new code, a fault would end the run
)
PREFILL_SWEEP = (
    # (the shipped config, the 22:50 sweep's best gate_up with its persistent down, is timed first anyway)
    C(128, 128, 64, 4, 8, 3, True, 256, 64, 8, 4),  # the 22:50 shipped config: down one program a tile
    C(128, 128, 64, 8, 8, 4, True, 256, 64, 8, 4, down_persistent=True),
    # gate and up tiles in one 4-D TMA box and one dot of N 256 (x read from shared memory once a K step)
    C(128, 128, 64, 4, 8, 3, True, 256, 64, 8, 3, down_persistent=True, fused_gate_up=True),
    C(128, 128, 64, 8, 8, 4, True, 256, 64, 8, 3, down_persistent=True, fused_gate_up=True),
    C(128, 128, 64, 4, 8, 3, True, 256, 128, 8, 2, down_persistent=True),
    C(128, 128, 64, 4, 8, 3, True, 128, 64, 4, 4, down_persistent=True),
    C(128, 128, 64, 4, 8, 3, True, 128, 64, 4, 3, down_persistent=True, programs_per_sm=2),  # 96 KB: two an SM
    C(128, 64, 64, 8, 4, 4, True, 256, 64, 8, 3, down_persistent=True, fused_gate_up=True),
    C(64, 128, 64, 8, 4, 4, True, 128, 64, 4, 4, down_persistent=True, fused_gate_up=True),
    C(128, 128, 64, 16, 8, 3, True, 256, 64, 8, 3, down_persistent=True),
    C(128, 128, 64, 8, 8, 3, True, persistent=True),
    C(128, 128, 64, 8, 8, 3, True, 128, 64, 4, 3),  # the down kernel at 96 KB: two programs an SM
    C(64, 128, 64, 8, 4, 4, True, 128, 64, 4, 4),  # half the padding rows of m128
    C(128, 64, 64, 8, 8, 3, True, 128, 64, 4, 4),  # gate_up at 96 KB and 124 registers: two programs an SM
    C(128, 128, 64, 8, 8, 3, True, atomic_combine=True),
    C(128, 128, 64, 8, 8, 4, True, 128, 64, 8, 4),
    C(128, 128, 64, 8, 8, 3, False, 128, 64, 4, 3),
    C(128, 128, 128, 8, 8, 2, True, 256, 128),
    C(256, 64, 64, 8, 8, 3, True, 128, 64, 8, 3),
)
# Alignment programs per launch and (columns, warps) of the combine: each timed alone, the fastest goes into the
# final combined config.
ALIGN_SWEEP = ((128, None), (64, None), (256, None), (256, True), (512, True), (1024, True), (128, True), (32, None))
COMBINE_SWEEP = ((1024, 4), (2048, 8), (2048, 4), (512, 4), (1024, 8), (512, 2), (256, 2), (4096, 8))


def problem(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, w_gate_up (E, 2I, H), w_down (E, H, I), routing weights and ids for ``num_tokens`` tokens, bf16."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=DEV, dtype=torch.bfloat16)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEV) * HIDDEN**-0.5).bfloat16()
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=DEV) * INTER**-0.5).bfloat16()
    logits = torch.randn(num_tokens, EXPERTS, generator=gen, device=DEV, dtype=torch.bfloat16)
    weights, ids = route(logits, TOP_K, normalize=True)
    return x, w_gate_up, w_down, weights, ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; a NaN or inf in out gives inf."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def graph_seconds(fn: Callable[[], object]) -> float:
    """Median seconds of one CUDA-graph replay of fn (run once first to compile)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e-3


def correctness(results: dict) -> bool:
    """The shipped launcher against the reference at decode, odd and prefill sizes; True when all pass."""
    ok = True
    for num_tokens in (1, 7, DECODE_TOKENS, PREFILL_TOKENS):
        x, w_gate_up, w_down, weights, ids = problem(num_tokens, seed=num_tokens)
        out = fm.fused_moe(x, w_gate_up, w_down, weights, ids)
        ref = fm.fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
        err = rel_err(out, ref)
        passed = err < 1e-2
        ok &= passed
        results["correctness"][f"T={num_tokens}"] = {"rel_err": err, "pass": passed}
        print(f"check T={num_tokens:5d} ({describe(fm.pick_config(num_tokens, EXPERTS, TOP_K))}): rel_err {err:.2e} "
              f"{'PASS' if passed else 'FAIL'}")  # fmt: skip
    return ok


def describe(cfg: fm.MoeKernelConfig) -> str:
    """A short name of a tile config: m32 n64 k128 g1 w4 s4 (+ " tma", ", down n128 k128 w4 s3" when the down
    kernel's tiles differ from the default)."""
    extra = (" tma" if cfg.tma else "") + (" atomic" if cfg.atomic_combine else "")
    extra += " persistent" if cfg.persistent else ""
    extra += " down-persistent" if cfg.down_persistent and not cfg.persistent else ""
    extra += " fused" if cfg.fused_gate_up else ""
    extra += f" x{cfg.programs_per_sm}/SM" if cfg.programs_per_sm != 1 else ""
    extra += " down-not-persistent" if cfg.down_persistent is False and cfg.persistent else ""
    if cfg.align_programs != fm.ALIGN_PROGRAMS or cfg.align_scan is not None:
        extra += f" align{cfg.align_programs}" + {None: "", True: " scan", False: " no-scan"}[cfg.align_scan]
    if (cfg.combine_block, cfg.combine_warps) != (1024, 4):
        extra += f" combine b{cfg.combine_block} w{cfg.combine_warps}"
    if cfg.down_block_n or cfg.down_block_k or cfg.down_num_warps or cfg.down_num_stages:
        extra += (f", down n{cfg.down_n} k{cfg.down_k} w{cfg.down_num_warps or cfg.num_warps} "
                  f"s{cfg.down_num_stages or cfg.num_stages}")  # fmt: skip
    return (f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} "
            f"s{cfg.num_stages}{extra}")  # fmt: skip


def stage_times(args: tuple[torch.Tensor, ...], cfg: fm.MoeKernelConfig) -> dict[str, float]:
    """Seconds of each of fused_moe's four steps alone (alignment, gate_up, down, combine), each in a CUDA graph."""
    x, w_gate_up, w_down, weights, ids = args
    align = fm.align_by_expert(ids, EXPERTS, cfg.block_m, cfg.align_programs, cfg.align_scan)
    act = fm.moe_gate_up(x, w_gate_up, align, TOP_K, cfg)
    down = fm.moe_down(act, w_down, weights, align, cfg)
    if cfg.atomic_combine:  # the down kernel summed per token in float32: the combine is the cast
        finish: Callable[[], object] = lambda: down.to(x.dtype)  # noqa: E731
    else:
        finish = lambda: fm.combine(down.view(x.shape[0], TOP_K, HIDDEN), cfg.combine_block, cfg.combine_warps)  # noqa: E731
    return {
        "align": graph_seconds(
            lambda: fm.align_by_expert(ids, EXPERTS, cfg.block_m, cfg.align_programs, cfg.align_scan)
        ),
        "gate_up": graph_seconds(lambda: fm.moe_gate_up(x, w_gate_up, align, TOP_K, cfg)),
        "down": graph_seconds(lambda: fm.moe_down(act, w_down, weights, align, cfg)),
        "combine": graph_seconds(finish),
    }


def print_stages(name: str, cfg: fm.MoeKernelConfig, times: dict[str, float], num_tokens: int) -> None:
    """One line of per-kernel times with each GEMM's TFLOP/s and the combine's TB/s."""
    n = num_tokens * TOP_K
    gate_up_tf = 2 * n * 2 * INTER * HIDDEN / times["gate_up"] / 1e12
    down_tf = 2 * n * INTER * HIDDEN / times["down"] / 1e12
    combine_bytes = num_tokens * HIDDEN * (4 + 2) if cfg.atomic_combine else (n + num_tokens) * HIDDEN * 2
    combine_tb = combine_bytes / times["combine"] / 1e12
    us = {k: v * 1e6 for k, v in times.items()}
    print(f"{name}: per kernel ({describe(cfg)}): align {us['align']:.1f} us, gate_up {us['gate_up']:.1f} us "
          f"({gate_up_tf:.0f} TFLOP/s), down {us['down']:.1f} us ({down_tf:.0f} TFLOP/s), combine "
          f"{us['combine']:.1f} us ({combine_tb:.2f} TB/s); sum {sum(us.values()):.1f} us")  # fmt: skip


def expert_bytes(ids: torch.Tensor) -> int:
    """Bytes of the experts ``ids`` touches (gate, up and down of each), bf16."""
    return int(torch.unique(ids).numel()) * 3 * HIDDEN * INTER * 2


def measure(args: tuple[torch.Tensor, ...], cfg: fm.MoeKernelConfig | None) -> float:
    """Seconds per fused_moe call with ``cfg`` (None: the shipped pick) under a CUDA graph."""
    x, w_gate_up, w_down, weights, ids = args
    return graph_seconds(lambda: fm.fused_moe(x, w_gate_up, w_down, weights, ids, cfg))


def bench(results: dict, name: str, num_tokens: int, sweep: tuple, deadline: float, rate: Callable) -> None:
    """Time the shipped pick, then the sweep's configs until ``deadline`` (each checked against the reference
    first, and timed whole and kernel by kernel), then the best gate_up and best down of the sweep combined;
    rate(seconds) -> (value, unit)."""
    args = problem(num_tokens, seed=1)
    x, w_gate_up, w_down, weights, ids = args
    ref = fm.fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    shipped = fm.pick_config(num_tokens, EXPERTS, TOP_K)
    seconds = measure(args, None)
    stages = stage_times(args, shipped)
    entry = {"shipped": describe(shipped), "seconds": seconds, "rate": rate(seconds)[0], "stages": stages}
    print(f"{name}: shipped {describe(shipped)}: {seconds * 1e6:.1f} us = {rate(seconds)[0]:.2f} {rate(seconds)[1]}")
    print_stages(name, shipped, stages, num_tokens)
    if use_pdl(x.device):  # the same without programmatic dependent launch, to show what it gives
        set_pdl(False)
        try:
            no_pdl = measure(args, None)
        finally:
            set_pdl(True)
        entry["seconds_no_pdl"] = no_pdl
        print(f"{name}: shipped without PDL: {no_pdl * 1e6:.1f} us = {rate(no_pdl)[0]:.2f} {rate(no_pdl)[1]}")
    timed = [(seconds, shipped, stages)]
    tuned = {**sweep_align(name, ids, shipped.block_m), **sweep_combine(name, args, shipped)} if sweep else {}
    for cfg in sweep:
        if time.monotonic() > deadline:
            print(f"{name}: sweep stopped at its time budget")
            break
        row = try_config(name, args, ref, cfg, num_tokens, rate)
        if row is not None:
            timed.append(row)
    combined = combine_best(timed)
    if combined is not None:
        combined = attrs.evolve(combined, **tuned)
    if combined is not None and all(combined != t[1] for t in timed) and time.monotonic() < deadline + 5:
        print(f"{name}: the best gate_up and the best down combined:")
        row = try_config(name, args, ref, combined, num_tokens, rate)
        if row is not None:
            timed.append(row)
    best = min(timed, key=lambda t: t[0])
    entry["best"], entry["best_rate"], entry["best_stages"] = describe(best[1]), rate(best[0])[0], best[2]
    entry["sweep"] = [{"config": describe(c), "seconds": t, "stages": st} for t, c, st in timed]
    print(f"{name}: best {best[1]!r}")
    results[name] = entry


def sweep_align(name: str, ids: torch.Tensor, block_m: int) -> dict:
    """The alignment's programs per launch and scan launch that time fastest (ALIGN_SWEEP), each first checked
    equal to the torch path (slots, block experts, slot count), as MoeKernelConfig fields ({} when none passes)."""
    ref = fm.align_by_expert_ref(ids, EXPERTS, block_m)
    best: tuple[float, dict] | None = None
    for programs, scan in ALIGN_SWEEP:
        got = fm.align_by_expert(ids, EXPERTS, block_m, programs, scan)
        fields = ("sorted_ids", "block_experts", "num_slots")
        label = f"align {programs} programs{' scan' if scan else ''}"
        if not all(torch.equal(getattr(got, f), getattr(ref, f)) for f in fields):
            print(f"{name}: {label} WRONG (left out)")
            continue
        seconds = graph_seconds(lambda p=programs, s=scan: fm.align_by_expert(ids, EXPERTS, block_m, p, s))
        plan = fm.align_plan(ids.numel(), EXPERTS, programs)
        print(f"{name}: {label} ({plan.chunks} chunks of {plan.tiles} tiles of {plan.tile}): {seconds * 1e6:.1f} us")
        if best is None or seconds < best[0]:
            best = (seconds, {"align_programs": programs, "align_scan": scan})
    return {} if best is None else best[1]


def sweep_combine(name: str, args: tuple[torch.Tensor, ...], cfg: fm.MoeKernelConfig) -> dict:
    """The combine's columns and warps that time fastest (COMBINE_SWEEP) over the down kernel's real output, each
    first checked bit-equal to the default combine (itself checked against the torch sum), as MoeKernelConfig
    fields ({} when none passes)."""
    x, w_gate_up, w_down, weights, ids = args
    plain = attrs.evolve(cfg, atomic_combine=False)
    align = fm.align_by_expert(ids, EXPERTS, plain.block_m)
    act = fm.moe_gate_up(x, w_gate_up, align, TOP_K, plain)
    rows = fm.moe_down(act, w_down, weights, align, plain).view(x.shape[0], TOP_K, HIDDEN)
    expected = fm.combine(rows)  # the default tiles; every variant sums in the same order, so bit-equal to it
    if rel_err(expected, rows.float().sum(dim=1)) >= 1e-2:
        print(f"{name}: combine WRONG against the torch sum (sweep skipped)")
        return {}
    best: tuple[float, dict] | None = None
    for block, warps in COMBINE_SWEEP:
        if not torch.equal(fm.combine(rows, block, warps), expected):
            print(f"{name}: combine b{block} w{warps} WRONG (left out)")
            continue
        seconds = graph_seconds(lambda b=block, w=warps: fm.combine(rows, b, w))
        tb = (rows.numel() + expected.numel()) * rows.element_size() / seconds / 1e12
        print(f"{name}: combine b{block} w{warps}: {seconds * 1e6:.1f} us ({tb:.2f} TB/s)")
        if best is None or seconds < best[0]:
            best = (seconds, {"combine_block": block, "combine_warps": warps})
    return {} if best is None else best[1]


def try_config(
    name: str,
    args: tuple[torch.Tensor, ...],
    ref: torch.Tensor,
    cfg: fm.MoeKernelConfig,
    num_tokens: int,
    rate: Callable,
) -> tuple[float, fm.MoeKernelConfig, dict[str, float]] | None:
    """(seconds, cfg, per-kernel seconds) of one config, or None when it fails or disagrees with ``ref``."""
    x, w_gate_up, w_down, weights, ids = args
    try:
        err = rel_err(fm.fused_moe(x, w_gate_up, w_down, weights, ids, cfg), ref)
        if not err < 1e-2:
            print(f"{name}: {describe(cfg)} WRONG: rel_err {err:.2e} (left out)")
            return None
        seconds, stages = measure(args, cfg), stage_times(args, cfg)
    except Exception as e:  # out of shared memory, a variant the compiler refuses: the sweep goes on
        print(f"{name}: {describe(cfg)} failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    print(f"{name}: {describe(cfg)}: {seconds * 1e6:.1f} us = {rate(seconds)[0]:.2f} {rate(seconds)[1]}")
    print_stages(name, cfg, stages, num_tokens)
    return seconds, cfg, stages


def combine_best(timed: list) -> fm.MoeKernelConfig | None:
    """The config with the fastest gate_up of the fastest block_m and the fastest down + combine of that block_m
    (the down's tiles, warps, stages and combine; TMA and grouping from the gate_up's), or None when nothing was
    timed."""
    if not timed:
        return None
    by_m: dict[int, list] = {}
    for row in timed:
        by_m.setdefault(row[1].block_m, []).append(row)

    def best_pair(rows: list) -> tuple[float, fm.MoeKernelConfig, fm.MoeKernelConfig]:
        gate_up = min(rows, key=lambda r: r[2]["gate_up"])
        down = min(rows, key=lambda r: r[2]["down"] + r[2]["combine"])
        return gate_up[2]["gate_up"] + down[2]["down"] + down[2]["combine"] + gate_up[2]["align"], gate_up[1], down[1]

    _, gate_up, down = min((best_pair(rows) for rows in by_m.values()), key=lambda p: p[0])
    return attrs.evolve(
        gate_up, down_block_n=down.down_n, down_block_k=down.down_k,
        down_num_warps=down.down_num_warps or down.num_warps, down_num_stages=down.down_num_stages or down.num_stages,
        atomic_combine=down.atomic_combine, persistent=gate_up.persistent, down_persistent=down.down_is_persistent,
        fused_gate_up=gate_up.fused_gate_up, programs_per_sm=down.programs_per_sm if down.down_is_persistent
        else gate_up.programs_per_sm,
    )  # fmt: skip


def end_to_end(results: dict) -> bool:
    """Greedy tokens of a tiny fp32 Qwen3-MoE through LLM on the GPU (graphs on) equal transformers'."""
    import random
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    path = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="moe-e2e-")), "qwen3_moe", head_dim=32, moe=moe)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    llm = LLM(path, dtype="float32", load_tokenizer=False, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = llm.executor.graphs is not None
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(16):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt) :])
    equal = sum(g == e for g, e in zip(got, expected, strict=True))
    results["end_to_end"] = {"prompts": len(prompts), "equal": equal, "cuda_graphs": graphs}
    print(f"end to end: {equal}/{len(prompts)} prompts equal transformers' greedy tokens (cuda graphs {graphs})")
    return equal == len(prompts)


def summary(results: dict) -> None:
    """The short table."""
    print("\n| case | shipped config | us | rate | best config | best rate | target |")
    print("|---|---|---|---|---|---|---|")
    for name, unit, target in (("decode", "TB/s", 3.0), ("prefill", "TFLOP/s", 500.0)):
        r = results.get(name)
        if r is None:
            continue
        print(f"| {name} T={r['tokens']} | {r['shipped']} | {r['seconds'] * 1e6:.1f} | {r['rate']:.2f} {unit} | "
              f"{r['best']} | {r['best_rate']:.2f} {unit} | >= {target} {unit} |")  # fmt: skip
    print("\n| case | config | align us | gate_up us | down us | combine us |")
    print("|---|---|---|---|---|---|")
    for name in ("decode", "prefill"):
        r = results.get(name)
        for label, key in (("shipped", "stages"), ("best", "best_stages")):
            if r is not None and key in r:
                us = [r[key][k] * 1e6 for k in ("align", "gate_up", "down", "combine")]
                print(f"| {name} {label} | {r[label]} | " + " | ".join(f"{u:.1f}" for u in us) + " |")
    print("correctness:", "PASS" if all(c["pass"] for c in results["correctness"].values()) else "FAIL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument("--budget-s", type=float, default=60.0, help="the whole run's budget in seconds (see above)")
    parser.add_argument("--no-sweep", action="store_true", help="time the shipped configs only")
    parser.add_argument("--e2e", action="store_true", help="also run the tiny model end to end against transformers")
    opts = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # every result line as it comes, also into a pipe or a file
    start = time.monotonic()
    results: dict = {"correctness": {}, "device": torch.cuda.get_device_name()}
    ok = correctness(results)
    decode_args = problem(DECODE_TOKENS, seed=1)
    touched = expert_bytes(decode_args[4])
    del decode_args
    bench(results, "decode", DECODE_TOKENS, () if opts.no_sweep else DECODE_SWEEP, start + opts.budget_s * 0.35,
          lambda s: (touched / s / 1e12, "TB/s"))  # fmt: skip
    flops = 2 * PREFILL_TOKENS * TOP_K * 3 * HIDDEN * INTER
    bench(results, "prefill", PREFILL_TOKENS, () if opts.no_sweep else PREFILL_SWEEP, start + opts.budget_s * 0.85,
          lambda s: (flops / s / 1e12, "TFLOP/s"))  # fmt: skip
    results["decode"]["tokens"], results["prefill"]["tokens"] = DECODE_TOKENS, PREFILL_TOKENS
    results["decode"]["expert_bytes"] = touched
    results["seconds"] = time.monotonic() - start
    summary(results)
    print(f"(benches done in {results['seconds']:.0f} s)")
    if opts.e2e:
        ok &= end_to_end(results)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)
    if not ok:
        sys.exit("FAILED: the kernel or the end-to-end run disagrees with its reference (see above)")


if __name__ == "__main__":
    main()
