"""The attention prologue (q/k norm, rotary, K/V store) at 1-16 rows on the H200: its old one-program-per-token
grid, the new per-head grid, and folded into the qkv projection's epilogue (Qwen3-0.6B shape, bf16).

    PYTHONPATH=$PWD python3 benchmarks/bench_qkv_epilogue.py [--rows 1,16] [--budget-s 95] [--smoke]

1. correctness: at rows 1, 4, 16 with bf16 and FP8 caches, the layer's residual add + RMSNorm + qkv projection
   + prologue by each variant against the old path (``norm_linear`` then ``norm_rope_store`` on its "token"
   grid): q, the new residual and both caches compared byte for byte ("exact", else the count of differing
   values and the largest difference), and the epilogue replayed in a CUDA graph 5 times (its arrival counters
   reset themselves).
2. prologue: device us per call of that layer piece (CUDA-graph replays, weights rotated past the L2, PDL on),
   per variant, with the epilogue at a few launch configs (``EPILOGUE_CONFIGS`` candidates).
3. step: the whole Qwen3-0.6B decode step (28 layers + logits, one CUDA graph, device us) at B = rows, contexts
   U(100, 384) as the latency bench, per variant ("token", "head", "epilogue"), logits compared with "token"
   and the epilogue step checked bit-exact over graph replays.
Tables print after each part and all together last. --smoke runs part 1 at tiny shapes under Triton's
interpreter (no GPU; checks the script).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fnvllm.kernels import fp8, skinny_gemm
from fnvllm.kernels.skinny_gemm import SkinnyConfig, norm_linear, norm_linear_rope_store
from fnvllm.kernels.store_kv import norm_rope_store

START = time.perf_counter()
# (Hq, Hkv, D, hidden) of the qkv projection.
SHAPES = {"0.6b": (16, 8, 128, 1024), "tiny": (4, 2, 16, 64)}
# Epilogue launch configs tried in part 2, by rows bucket (the first is the product's own config).
CANDIDATES = {
    1: [
        None,
        SkinnyConfig(1, 16, 1024, 1, 4, 1, use_dot=False, preload=True),
        SkinnyConfig(1, 32, 1024, 1, 8, 1, use_dot=False, preload=True),
    ],
    16: [None, SkinnyConfig(16, 16, 256, 1, 4, 1, preload=True), SkinnyConfig(16, 64, 128, 1, 4, 3)],
}
VARIANTS = ("token", "head", "epilogue")
TABLES: list[str] = []


def say(line: str) -> None:
    """Print a line now (flushed) and keep it for the tables printed last."""
    print(line, flush=True)
    TABLES.append(line)


def layer_inputs(rows: int, shape: str, cache_dtype: torch.dtype, device: str, copies: int = 1) -> dict:
    """Hidden x and residual (rows, hidden), norm weights, `copies` qkv weights, angles, slots and caches
    (64 blocks of 16 slots; FP8 with per-head scales)."""
    hq, hkv, d, hidden = SHAPES[shape]
    gen = torch.Generator().manual_seed(rows)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(torch.bfloat16).to(device)

    angles = torch.rand(rows, d // 2, generator=gen) * 100
    cache_shape = (64, 16, hkv, d)
    scales = (torch.rand(hkv, generator=gen) + 0.5, torch.rand(hkv, generator=gen) + 0.5)
    return {
        "x": rand(rows, hidden),
        "res": rand(rows, hidden),
        "nw": (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).to(device),
        "ws": [rand((hq + 2 * hkv) * d, hidden, scale=hidden**-0.5) for _ in range(copies)],
        "qw": (torch.rand(d, generator=gen) + 0.5).to(torch.bfloat16).to(device),
        "kw": (torch.rand(d, generator=gen) + 0.5).to(torch.bfloat16).to(device),
        "cos": angles.cos().to(device),
        "sin": angles.sin().to(device),
        "slots": torch.randperm(64 * 16, generator=gen)[:rows].to(device),
        "kv": [torch.zeros(cache_shape, device=device).to(cache_dtype) for _ in range(2)],
        "scales": tuple(s.to(device) for s in scales) if cache_dtype == fp8.FP8_DTYPE else (),
        "heads": (hq, hkv),
    }


def run_variant(variant: str, inp: dict, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, new residual) of the layer piece by `variant`, with weight copy i; writes inp's caches."""
    hq, hkv = inp["heads"]
    w = inp["ws"][i % len(inp["ws"])]
    rest = (hq, hkv, inp["qw"], inp["kw"], 1e-6, inp["cos"], inp["sin"], *inp["kv"], inp["slots"], *inp["scales"])
    if variant == "epilogue":
        return norm_linear_rope_store(inp["x"], inp["res"], inp["nw"], 1e-6, w, None, *rest)
    qkv, residual = norm_linear(inp["x"], inp["res"], inp["nw"], 1e-6, w, None)
    return norm_rope_store(qkv, *rest, grid=variant), residual


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    """ "exact" when the bytes agree, else how many values differ and the largest difference."""
    if a.dtype == fp8.FP8_DTYPE:
        if torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return "exact"
        a, b = a.float(), b.float()
    if torch.equal(a, b):
        return "exact"
    diff = (a.float() - b.float()).abs()
    return f"{int((diff > 0).sum())} differ, max {float(diff.max()):.3g}"


def check_correctness(shape: str, device: str, rows_list: tuple[int, ...]) -> bool:
    """Part 1: every variant against "token" (outputs and caches byte for byte), and the epilogue's graph
    replays; returns whether all were exact."""
    all_exact = True
    say("part 1: correctness against norm_linear + norm_rope_store (token grid): q | residual | k cache | v cache")
    for rows in rows_list:
        for cache_name, cache_dtype in (("bf16", torch.bfloat16), ("fp8", fp8.FP8_DTYPE)):
            ref = layer_inputs(rows, shape, cache_dtype, device)
            q_ref, res_ref = run_variant("token", ref)
            for variant in VARIANTS[1:]:
                try:
                    verdicts = check_variant(variant, rows, shape, cache_dtype, device, ref, q_ref, res_ref)
                except Exception as e:  # a variant that fails is reported; the other parts still run
                    verdicts = [f"FAILED {type(e).__name__}: {str(e)[:200]}"]
                all_exact &= all(v.endswith("exact") for v in verdicts)
                say(f"  rows {rows:2d} {cache_name} {variant:8s}: " + " | ".join(verdicts))
    return all_exact


def check_variant(
    variant: str,
    rows: int,
    shape: str,
    cache_dtype: torch.dtype,
    device: str,
    ref: dict,
    q_ref: torch.Tensor,
    res_ref: torch.Tensor,
) -> list[str]:
    """The verdicts of one variant against the "token" outputs: q | residual | k cache | v cache (| replays)."""
    inp = layer_inputs(rows, shape, cache_dtype, device)
    q, res = run_variant(variant, inp)
    verdicts = [compare(q, q_ref), compare(res, res_ref)]
    verdicts += [compare(a, b) for a, b in zip(inp["kv"], ref["kv"], strict=True)]
    if variant == "epilogue" and device == "cuda":
        verdicts.append("replays " + epilogue_replays_exact(inp, q_ref))
    return verdicts


def epilogue_replays_exact(inp: dict, q_ref: torch.Tensor) -> str:
    """ "exact" when 5 CUDA-graph replays of the epilogue variant all give q_ref, else what differed."""
    run_variant("epilogue", inp)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, _ = run_variant("epilogue", inp)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(q, q_ref):
            return compare(q, q_ref)
    return "exact"


def time_prologue(rows_list: tuple[int, ...]) -> None:
    """Part 2: device us per call of the layer piece per variant (and epilogue configs), weights rotated."""
    from bench_small_batch import graph_time_us

    say("part 2: norm + qkv + prologue, device us per call (CUDA-graph replays, 16 weight copies = 128 MiB)")
    for rows in rows_list:
        inp = layer_inputs(rows, "0.6b", torch.bfloat16, "cuda", copies=16)
        cells = []
        for variant in VARIANTS[:2]:
            cells.append(f"{variant} {graph_time_us(functools.partial(run_variant, variant, inp), 16, 10):.2f}")
        hq, hkv, d, hidden = SHAPES["0.6b"]
        key = ((hq + 2 * hkv) * d, hidden, skinny_gemm.rows_bucket(rows) or 0)
        for cfg in CANDIDATES.get(skinny_gemm.rows_bucket(rows) or 0, [None]):
            label = "epilogue(own cfg)" if cfg is None else f"epilogue(bn {cfg.block_n} bk {cfg.block_k})"
            saved = dict(skinny_gemm.EPILOGUE_CONFIGS)
            if cfg is not None:
                skinny_gemm.EPILOGUE_CONFIGS[key] = cfg
            try:
                cells.append(f"{label} {graph_time_us(functools.partial(run_variant, 'epilogue', inp), 16, 10):.2f}")
            except Exception as e:  # a config that fails to compile is reported
                cells.append(f"{label} FAILED {type(e).__name__}")
            finally:
                skinny_gemm.EPILOGUE_CONFIGS.clear()
                skinny_gemm.EPILOGUE_CONFIGS.update(saved)
        say(f"  rows {rows:2d}: " + " | ".join(cells))


def step_models() -> dict[str, torch.nn.Module]:
    """The Qwen3-0.6B model (random bf16 weights, shared) with the Triton ops per variant: "token"
    (norm_rope_store on its per-token grid, the old default), "head" (on its per-head grid, the default at <= 16
    tokens since 2026-12-02), "epilogue" (FNVLLM_QKV_EPILOGUE=1)."""
    from fnvllm.model import DecoderForCausalLM, ModelConfig
    from fnvllm.model.ops import triton_ops
    from fnvllm.testing.checkpoints import _QWEN3_COMMON, QWEN3_SHAPES

    config = ModelConfig.from_dict({**_QWEN3_COMMON, **QWEN3_SHAPES["qwen3-0.6b"], "torch_dtype": "bfloat16"})
    base = triton_ops(fused_prologues=True, qkv_epilogue=False)
    ops = {
        "token": attrs.evolve(base, norm_rope_store=functools.partial(norm_rope_store, grid="token")),
        "head": attrs.evolve(base, norm_rope_store=functools.partial(norm_rope_store, grid="head")),
        "epilogue": triton_ops(fused_prologues=True, qkv_epilogue=True),
    }
    models: dict[str, torch.nn.Module] = {}
    for label, model_ops in ops.items():
        with torch.device("cuda"):
            models[label] = DecoderForCausalLM(config, model_ops).eval()
        if len(models) > 1:
            models[label].load_state_dict(models["token"].state_dict())
    return models


def time_steps(rows_list: tuple[int, ...], until_s: float) -> None:
    """Part 3: the whole decode step's device time per variant at B = rows (stops starting batches past
    until_s of wall time)."""
    from bench_small_batch import graph_time_us, replays_exact, run_step, step_inputs

    from fnvllm.kernels.backends import get_backend

    models, backend = step_models(), get_backend("triton")
    say("part 3: whole Qwen3-0.6B decode step, device us (one CUDA graph; contexts U(100, 384))")
    for b in rows_list:
        if time.perf_counter() - START > until_s:
            say(f"  B={b}: not run (past {until_s:.0f} s)")
            continue
        ids, caches, meta = step_inputs(models["token"], b, (100, 384))
        cells, logits = [], {}
        for label, model in models.items():
            step: Callable[[int], torch.Tensor] = functools.partial(run_step, model, ids, caches, meta, backend)
            try:
                logits[label] = step(0).float()
                us = graph_time_us(step, 1, repeats=20)
            except Exception as e:  # a variant that fails is reported; the others still run
                cells.append(f"{label} FAILED {type(e).__name__}: {str(e)[:150]}")
                continue
            base = logits.get("token", logits[label])
            same = "same logits" if torch.equal(logits[label], base) else "logits DIFFER"
            if same != "same logits":
                same += f" (max {float((logits[label] - base).abs().max()):.3g})"
            extra = f", replays {replays_exact(step, logits[label])}" if label == "epilogue" else ""
            cells.append(f"{label} {us:.1f} ({same}{extra})")
        say(f"  B={b:2d}: " + " | ".join(cells))


def main() -> None:
    """Parse the flags, run the parts, print the tables again at the end."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16", help="comma-separated batch rows for parts 2 and 3")
    parser.add_argument("--budget-s", type=float, default=95.0, help="wall seconds after which part 3 stops")
    parser.add_argument("--smoke", action="store_true", help="part 1 at tiny shapes under the interpreter")
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    if args.smoke:
        skinny_gemm.on_gpu = lambda x: True  # the GPU paths (skinny products, the epilogue) under the interpreter
        skinny_gemm.prefers_skinny = lambda m, n, k: 0 < m <= 16
        ok = check_correctness("tiny", "cpu", (1, 4))
        print("smoke:", "all exact" if ok else "NOT EXACT")
        return
    check_correctness("0.6b", "cuda", (1, 4, 16))
    time_steps(rows, args.budget_s * 0.6)  # the whole step first: the number that decides the default
    if time.perf_counter() - START < args.budget_s * 0.8:
        time_prologue(rows)
    print("\n==== tables ====")
    for line in TABLES:
        print(line)
    print(f"wall {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
