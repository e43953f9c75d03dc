"""Small-batch decode on the GPU, kernel by kernel, old against new (Qwen3-0.6B shape, bf16, H200).

    PYTHONPATH=$PWD python3 benchmarks/bench_small_batch.py [--shape 0.6b|8b] [--rows 1,16,64] [--sweep] [--json FILE]

Every kernel is checked against its reference first (a WRONG flag in the table when not), then timed as CUDA-graph
replays (launch overhead excluded, as in the engine's decode graphs) with its large inputs rotated past the 50 MiB
L2 (each call of the graph reads a different copy of the weights or KV cache, as 28 layers do), with programmatic
dependent launch as the checkout defaults it (on, on Hopper). "Base" tables are main's at 5476cd1
(``BASE_TUNED``; no fused-prologue or small-batch decode entries).
1. The four projections at M rows: cuBLAS (``F.linear``), an old dispatch (cuBLAS, or the skinny kernel plus its
   split-K sum kernel), the skinny kernel at this checkout's config (new) and, with --sweep, a few launch configs
   (benchmarks/sweep_small.py sweeps more, within a time budget).
   Also SiLU-and-mul + down_proj: two launches (old) against the skinny kernel loading silu(gate) * up (new),
   and residual add + RMSNorm + qkv / gate_up: two launches (old) against the skinny kernel normalising on load.
2. q/k norm + rotary + KV store: two ``norm_rotary`` launches and ``store_kv`` (old) against the one fused kernel
   ``store_kv.norm_rope_store`` (new), at M decode rows.
3. Decode attention as the launcher picks it, contexts U(100, 1024), under the base tables (old) and this
   checkout's (new), at B = M sequences.
4. The whole decode step (28 layers + logits, one CUDA graph replay, device time only): the base step (main's ops
   and tables at 5476cd1), this checkout's defaults (new) and the defaults with the norm / SiLU prologues fused
   where ``prefers_fused`` says (fused), at B = M sequences; the new variants checked bit-exact over graph replays
   and against the base logits.
Tables last: one line per measurement, microseconds per call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from fnvllm.kernels import fused_ops, store_kv
from fnvllm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from fnvllm.kernels.skinny_gemm import TUNED_CONFIGS, Norm, SkinnyConfig, Tuned, skinny_config, skinny_linear

GEMMS = {
    "0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)},
}
HEADS = {"0.6b": (16, 8, 128), "8b": (32, 8, 128)}
ROTATE_BYTES = 256 << 20  # bytes of copies a timed graph cycles through (5x the H200's L2)


def graph_time_us(fn: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """Best mean device microseconds of fn(i) for i in 0..calls-1, captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 2)):  # warm-up: compiles
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    del graph  # its memory pool goes back before the next capture
    return best


def old_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``skinny_gemm.linear``'s dispatch before this change: cuBLAS, or (only narrow, deep products at <= 16 rows)
    the skinny kernel at its heuristic config plus the split-K sum kernel."""
    m, (n, k) = x.shape[0], w.shape
    if not (0 < m <= 16 and n <= 2048 and k >= 2 * n):
        return F.linear(x, w, bias)
    return skinny_linear(x, w, bias, _heuristic_config(m, n, k)._replace(fused_reduce=False))


def _heuristic_config(m: int, n: int, k: int) -> SkinnyConfig:
    """skinny_config's heuristic, ignoring the tuned table."""
    saved = dict(TUNED_CONFIGS)
    TUNED_CONFIGS.clear()
    try:
        return skinny_config.__wrapped__(m, n, k)
    finally:
        TUNED_CONFIGS.update(saved)


def sweep_configs(m: int) -> list[SkinnyConfig]:
    """Launch configs tried at m rows: tensor-core tiles, and CUDA-core ones (unpadded rows) up to 4 rows."""
    bm = max(16, 1 << (m - 1).bit_length())
    dot_tiles = ((16, 128, 4, 4), (32, 128, 4, 4), (16, 256, 4, 3), (64, 64, 4, 4))
    out = [SkinnyConfig(bm, bn, bk, s, w, st) for bn, bk, w, st in dot_tiles for s in (1, 2, 4)]
    out += [cfg._replace(fused_reduce=False) for cfg in out if cfg.split_k > 1]  # the separate sum kernel
    if m <= 4:
        sm = 1 << (m - 1).bit_length()
        sum_tiles = ((8, 256, 4, 3), (16, 256, 4, 3), (4, 512, 4, 2), (32, 128, 8, 3))
        out += [SkinnyConfig(sm, bn, bk, s, w, st, use_dot=False) for bn, bk, w, st in sum_tiles for s in (1, 2, 4)]
    return out


def _call_rotating(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor], i: int
) -> torch.Tensor:
    """fn(x, the i-th weight copy, cyclically)."""
    return fn(x, weights[i % len(weights)])


def time_rotating(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, weights: list) -> float:
    """us per call of fn(x, w) with w cycling through the weight copies (one graph over all of them)."""
    return graph_time_us(functools.partial(_call_rotating, fn, x, weights), len(weights))


def _gemm_ok(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """Within bf16 rounding of the float32 product."""
    return (got.float() - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8


def bench_gemms(shape: str, rows: list[int], sweep: bool, out: list[dict[str, object]]) -> None:
    """Part 1: the projections (see the module docstring)."""
    for name, (k, n) in GEMMS[shape].items():
        copies = max(2, ROTATE_BYTES // (2 * n * k))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            exact = F.linear(x.float(), weights[0].float())

            row: dict[str, object] = {"part": "gemm", "shape": shape, "gemm": name, "m": m, "mb": 2 * n * k / 1e6}
            row["cublas_us"] = time_rotating(F.linear, x, weights)
            row["old_us"] = time_rotating(old_linear, x, weights)
            default = skinny_config(m, n, k)
            new = functools.partial(skinny_linear, config=default)
            row["new_us"], row["new_cfg"] = time_rotating(new, x, weights), tuple(default)
            row["ok"] = _gemm_ok(new(x, weights[0]), exact) and _gemm_ok(old_linear(x, weights[0]), exact)
            best, best_cfg = row["new_us"], default
            for cfg in sweep_configs(m) if sweep else []:
                if not _gemm_ok(skinny_linear(x, weights[0], None, cfg), exact):
                    row["ok"] = False
                    print(f"WRONG: {name} m={m} {cfg}")
                    continue
                us = time_rotating(functools.partial(skinny_linear, config=cfg), x, weights)
                if us < best:  # type: ignore[operator]
                    best, best_cfg = us, cfg
            row["best_us"], row["best_cfg"] = best, tuple(best_cfg)
            out.append(row)
            if name == "down":
                out.append(bench_silu_down(shape, m, weights, best_cfg))
            if name in ("qkv", "gate_up"):
                out.append(bench_norm_proj(shape, name, m, weights, best_cfg))
        weights.clear()
        torch.cuda.empty_cache()


def _old_silu_down(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Before: the SiLU-and-mul kernel, then the down projection's dispatch."""
    return old_linear(fused_ops.silu_and_mul(x), w)


def bench_silu_down(shape: str, m: int, weights: list[torch.Tensor], cfg: SkinnyConfig) -> dict[str, object]:
    """SiLU-and-mul + down_proj: two launches (old) against the skinny kernel's GLU prologue at cfg (new)."""
    k = weights[0].shape[1]
    x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    exact = F.linear(fused_ops.silu_and_mul(x).float(), weights[0].float())
    new = functools.partial(skinny_linear, config=cfg._replace(block_m=max(cfg.block_m, m)), glu=True)
    row: dict[str, object] = {"part": "silu_down", "shape": shape, "m": m}
    row["ok"] = _gemm_ok(new(x, weights[0]), exact) and _gemm_ok(_old_silu_down(x, weights[0]), exact)
    row["old_us"] = time_rotating(_old_silu_down, x, weights)
    row["new_us"] = time_rotating(new, x, weights)
    return row


def _old_norm_proj(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """Before: the residual add + RMSNorm kernel, then the projection's dispatch."""
    normed, _ = fused_ops.fused_add_rmsnorm(x, res, nw, 1e-6)
    return old_linear(normed, w)


def _new_norm_proj(
    cfg: SkinnyConfig, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, res_out: torch.Tensor
) -> torch.Tensor:
    """After: one skinny launch with the norm on load."""
    return skinny_linear(x, w, None, cfg, norm=Norm(nw, 1e-6, res, res_out))


def bench_norm_proj(shape: str, name: str, m: int, weights: list[torch.Tensor], cfg: SkinnyConfig) -> dict[str, object]:
    """Residual add + RMSNorm + qkv / gate_up: two launches (old: norm kernel, then cuBLAS or skinny) against the
    skinny kernel's norm prologue at cfg, the sweep's best for the projection (new)."""
    k = weights[0].shape[1]
    x, res = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nw, res_out = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, torch.empty_like(x)
    exact = F.linear(fused_ops.fused_add_rmsnorm(x, res, nw, 1e-6)[0].float(), weights[0].float())
    old = functools.partial(_old_norm_proj, res=res, nw=nw)
    new = functools.partial(_new_norm_proj, cfg, res=res, nw=nw, res_out=res_out)
    row: dict[str, object] = {"part": f"norm_{name}", "shape": shape, "m": m}
    row["ok"] = _gemm_ok(new(x, weights[0]), exact) and _gemm_ok(old(x, weights[0]), exact)
    row["old_us"] = time_rotating(old, x, weights)
    row["new_us"] = time_rotating(new, x, weights)
    return row


def rope_inputs(m: int, heads: tuple[int, int, int], copies: int) -> dict[str, object]:
    """A qkv projection output of m decode rows, q/k norm weights, cos/sin and `copies` layer caches."""
    hq, hkv, d = heads
    qkv = torch.randn(m, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    blocks, block = max(2, m), 256
    caches = [
        (torch.zeros(blocks, block, hkv, d, device="cuda", dtype=torch.bfloat16), torch.zeros(blocks, block, hkv, d,
         device="cuda", dtype=torch.bfloat16)) for _ in range(copies)
    ]  # fmt: skip
    angles = torch.rand(m, d // 2, device="cuda") * 6.28
    slots = torch.randperm(blocks * block, device="cuda")[:m].to(torch.int64)
    weights = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5, torch.rand(d, device="cuda").bfloat16() + 0.5
    return {"qkv": qkv, "caches": caches, "cos": angles.cos(), "sin": angles.sin(), "slots": slots, "w": weights}


def old_norm_rope_store(inp: dict[str, object], heads: tuple[int, int, int], i: int) -> torch.Tensor:
    """Before: norm_rotary on q, norm_rotary on k (each reading the strided view), then store_kv."""
    hq, hkv, d = heads
    qkv, (qw, kw), caches = inp["qkv"], inp["w"], inp["caches"]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # type: ignore[union-attr]
    t = qkv.shape[0]  # type: ignore[union-attr]
    q = fused_ops.norm_rotary(q.view(t, hq, d), qw, 1e-6, inp["cos"], inp["sin"])  # type: ignore[arg-type]
    k = fused_ops.norm_rotary(k.view(t, hkv, d), kw, 1e-6, inp["cos"], inp["sin"])  # type: ignore[arg-type]
    k_cache, v_cache = caches[i % len(caches)]  # type: ignore[index]
    store_kv.store_kv(k, v.view(t, hkv, d), k_cache, v_cache, inp["slots"])  # type: ignore[arg-type]
    return q


def new_norm_rope_store(inp: dict[str, object], heads: tuple[int, int, int], i: int) -> torch.Tensor:
    """After: one kernel."""
    hq, hkv, _ = heads
    k_cache, v_cache = inp["caches"][i % len(inp["caches"])]  # type: ignore[index]
    qw, kw = inp["w"]  # type: ignore[misc]
    return store_kv.norm_rope_store(
        inp["qkv"], hq, hkv, qw, kw, 1e-6, inp["cos"], inp["sin"], k_cache, v_cache, inp["slots"]
    )  # type: ignore[arg-type]


def bench_norm_rope_store(shape: str, rows: list[int], out: list[dict[str, object]]) -> None:
    """Part 2 (skipped when the fused kernel is not in this checkout)."""
    if not hasattr(store_kv, "norm_rope_store"):
        print("store_kv.norm_rope_store missing: part 2 skipped")
        return
    heads = HEADS[shape]
    for m in rows:
        inp = rope_inputs(m, heads, copies=8)
        q_old = old_norm_rope_store(inp, heads, 0)
        kv_old = [c.clone() for c in inp["caches"][0]]  # type: ignore[index]
        for c in inp["caches"][0]:  # type: ignore[index]
            c.zero_()
        q_new = new_norm_rope_store(inp, heads, 0)
        kv_new = inp["caches"][0]  # type: ignore[index]
        close = functools.partial(torch.allclose, rtol=1e-2, atol=1e-2)  # bf16: a unit in the last place at most
        ok = close(q_old.float(), q_new.float()) and all(
            close(a.float(), b.float()) for a, b in zip(kv_old, kv_new, strict=True)
        )
        row = {"part": "norm_rope_store", "shape": shape, "m": m, "ok": ok}
        row["old_us"] = graph_time_us(functools.partial(old_norm_rope_store, inp, heads), 8)
        row["new_us"] = graph_time_us(functools.partial(new_norm_rope_store, inp, heads), 8)
        out.append(row)


def decode_case(shape: str, b: int) -> dict[str, object]:
    """B = b sequences of contexts U(100, 1024), tables 4096 tokens wide (as the bench's graphs capture them), with
    enough copies of the caches and tables to cycle past L2."""
    heads, kv_heads, dim = HEADS[shape]
    block, width = 256, 16
    rng = random.Random(b)
    lens = [rng.randint(100, 1024) for _ in range(b)]
    used = sum(-(-n // block) for n in lens)
    copies = max(2, min(32, ROTATE_BYTES // (used * block * kv_heads * dim * 4)))
    caches, tables = [], []
    for _ in range(copies):
        k_cache = torch.randn(used + 1, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        caches.append((k_cache, torch.randn_like(k_cache)))
        table = torch.zeros(b, width, dtype=torch.int32)
        ids = (torch.randperm(used) + 1).tolist()
        for s, n in enumerate(lens):
            nb = -(-n // block)
            table[s, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
            ids = ids[nb:]
        tables.append(table.cuda())
    q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    return {"q": q, "caches": caches, "tables": tables, "seq_lens": seq_lens, "scale": dim**-0.5}


def decode_call(case: dict[str, object], i: int) -> torch.Tensor:
    """paged_decode_attention, its knobs chosen by the launcher, on the i-th copy (cyclically)."""
    caches, tables = case["caches"], case["tables"]
    k_cache, v_cache = caches[i % len(caches)]  # type: ignore[index, arg-type]
    table = tables[i % len(tables)]  # type: ignore[index, arg-type]
    return paged_decode_attention(case["q"], k_cache, v_cache, table, case["seq_lens"], case["scale"])  # type: ignore[arg-type]


def bench_decode(shape: str, rows: list[int], out: list[dict[str, object]]) -> None:
    """Part 3: decode attention as the launcher picks it under the base tables (old) and this checkout's (new)."""
    for b in rows:
        case = decode_case(shape, b)
        (k_cache, v_cache), table = case["caches"][0], case["tables"][0]  # type: ignore[index]
        ref = paged_decode_attention_ref(
            case["q"].float(), k_cache.float(), v_cache.float(), table, case["seq_lens"], case["scale"]
        )  # type: ignore[union-attr, arg-type]
        copies = len(case["caches"])  # type: ignore[arg-type]
        row: dict[str, object] = {"part": "decode", "shape": shape, "b": b, "ok": True}
        for label in ("old", "new"):
            with base_tables() if label == "old" else contextlib.nullcontext():
                ok = (decode_call(case, 0).float() - ref).abs().max().item() < 2e-2
                row["ok"] = row["ok"] and ok
                row[f"{label}_us"] = graph_time_us(functools.partial(decode_call, case), copies)
        out.append(row)


# skinny_gemm.TUNED_CONFIGS as main had it at 5476cd1 (before benchmarks/sweep_small.py's tables): the "base" step.
BASE_TUNED = {
    (4096, 1024, 1): Tuned(SkinnyConfig(16, 32, 128, 1, 4, 4), 5.13, 4.96),
    (4096, 1024, 16): Tuned(SkinnyConfig(16, 32, 128, 1, 4, 4), 5.21, 5.32),
    (4096, 1024, 64): Tuned(SkinnyConfig(64, 32, 128, 1, 4, 4), 5.20, 5.40),
    (1024, 2048, 1): Tuned(SkinnyConfig(16, 32, 128, 4, 4, 4), 5.23, 10.46),
    (1024, 2048, 16): Tuned(SkinnyConfig(16, 32, 128, 4, 4, 4), 5.36, 5.87),
    (1024, 2048, 64): Tuned(SkinnyConfig(64, 16, 256, 1, 4, 3), 6.18, 5.80),
    (6144, 1024, 1): Tuned(SkinnyConfig(16, 32, 128, 1, 4, 4), 6.33, 6.32),
    (6144, 1024, 16): Tuned(SkinnyConfig(16, 32, 128, 1, 4, 4), 6.38, 6.24),
    (6144, 1024, 64): Tuned(SkinnyConfig(64, 32, 128, 1, 4, 4), 6.69, 6.44),
    (1024, 3072, 1): Tuned(SkinnyConfig(16, 32, 128, 4, 4, 4), 6.19, 7.56),
    (1024, 3072, 16): Tuned(SkinnyConfig(16, 32, 128, 4, 4, 4), 6.25, 7.85),
    (1024, 3072, 64): Tuned(SkinnyConfig(64, 32, 128, 4, 4, 4), 6.82, 7.92),
}


@contextlib.contextmanager
def base_tables() -> Iterator[None]:
    """Within: the tuned tables as at 5476cd1 (BASE_TUNED, no fused-prologue or small-batch decode entries)."""
    from fnvllm.kernels import decode_attention, skinny_gemm

    saved = dict(skinny_gemm.TUNED_CONFIGS), dict(skinny_gemm.FUSED_TIMES), dict(decode_attention.SMALL_BATCH_DECODE)
    tables = (skinny_gemm.TUNED_CONFIGS, skinny_gemm.FUSED_TIMES, decode_attention.SMALL_BATCH_DECODE)
    for table, base in zip(tables, (BASE_TUNED, {}, {}), strict=True):
        table.clear()
        table.update(base)
    skinny_config.cache_clear()
    try:
        yield
    finally:
        for table, kept in zip(tables, saved, strict=True):
            table.clear()
            table.update(kept)
        skinny_config.cache_clear()


def build_models(shape: str, variants: set[str] | None = None) -> dict[str, torch.nn.Module]:
    """The model of ``shape`` (random bf16 weights, shared values) with: "base", the Triton ops as main had them at
    5476cd1 (no fused prologues; run under ``base_tables``); "new" (also "triton"), the defaults of this checkout;
    "fused", the defaults with the norm / SiLU prologues fused into the projections wherever ``prefers_fused``
    says. ``variants``: the labels to build (default base, new, fused)."""
    from fnvllm.model import DecoderForCausalLM, ModelConfig
    from fnvllm.model.ops import triton_ops
    from fnvllm.testing.checkpoints import _QWEN3_COMMON, QWEN3_SHAPES

    name = {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b"}[shape]
    config = ModelConfig.from_dict({**_QWEN3_COMMON, **QWEN3_SHAPES[name], "torch_dtype": "bfloat16"})
    makers = {"base": lambda: triton_ops(fused_prologues=False), "new": triton_ops, "triton": triton_ops,
              "fused": lambda: triton_ops(True)}  # fmt: skip
    models: dict[str, torch.nn.Module] = {}
    for label in sorted(variants or {"base", "new", "fused"}):
        with torch.device("cuda"):
            models[label] = DecoderForCausalLM(config, makers[label]()).eval()  # parameters in the config's bf16
        if len(models) > 1:
            models[label].load_state_dict(next(iter(models.values())).state_dict())
    return models


def step_inputs(
    model: torch.nn.Module, b: int, context: tuple[int, int] = (100, 1024)
) -> tuple[torch.Tensor, list, object]:
    """(input ids, per-layer KV caches, metadata) of one decode step of b sequences, contexts U(*context), block
    256, tables 16 blocks wide (as the engine's graphs capture them)."""
    from fnvllm.executor.device_inputs import build_attention_metadata
    from fnvllm.kernels.attention import KVCache

    config, block, width = model.config, 256, 16
    rng = random.Random(b)
    lens = [rng.randint(*context) for _ in range(b)]
    tables, next_block = [], 1
    for n in lens:
        nb = -(-n // block)
        tables.append(list(range(next_block, next_block + nb)) + [0] * (width - nb))
        next_block += nb
    shape = (next_block, block, config.num_key_value_heads, config.head_dim)
    caches = [KVCache(torch.randn(shape, device="cuda").bfloat16(), torch.randn(shape, device="cuda").bfloat16())
              for _ in range(config.num_hidden_layers)]  # fmt: skip
    meta = build_attention_metadata([n - 1 for n in lens], [1] * b, tables, block, "cuda")
    ids = torch.randint(0, config.vocab_size, (b,), device="cuda")
    return ids, caches, meta


def run_step(
    model: torch.nn.Module, ids: torch.Tensor, caches: list, meta: object, backend: object, _i: int
) -> torch.Tensor:
    """One decode step: the forward pass and the logits."""
    with torch.inference_mode():
        return model.compute_logits(model(ids, meta.positions, caches, meta, backend))  # type: ignore[attr-defined]


def replays_exact(step: Callable[[int], torch.Tensor], expected: torch.Tensor) -> str:
    """ "exact" when 10 CUDA-graph replays of the step all give the eager step's logits bit for bit (split-K
    counters, PDL weight preloads), else what differed."""
    graph, static = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        static = step(0)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(static.float(), expected):
            return "replay differs"
    return "exact"


def bench_step(shape: str, rows: list[int], out: list[dict[str, object]]) -> None:
    """Part 4: the whole decode step's device time (forward + logits, one CUDA graph), PDL on (the default): the
    base step (main at 5476cd1: its ops and tables), the new defaults, and the new ones with the fused prologues;
    each new variant checked bit-exact over graph replays and against the base logits."""
    from fnvllm.kernels.backends import get_backend

    models = build_models(shape)
    backend = get_backend("triton")
    for b in rows:
        ids, caches, meta = step_inputs(models["new"], b)
        row: dict[str, object] = {"part": "step", "shape": shape, "b": b}
        steps = {label: functools.partial(run_step, model, ids, caches, meta, backend)
                 for label, model in models.items()}  # fmt: skip
        logits = {}
        for label, step in steps.items():
            with base_tables() if label == "base" else contextlib.nullcontext():
                logits[label] = step(0).float()
                row[f"{label}_us"] = graph_time_us(step, 1, repeats=20)
                row[f"{label}_replay"] = replays_exact(step, logits[label])
        top = logits["base"].abs().max().item()
        row["ok"] = True
        for label in ("new", "fused"):
            diff = (logits["base"] - logits[label]).abs().max().item()
            same = (logits["base"].argmax(-1) == logits[label].argmax(-1)).float().mean().item()
            row["ok"] = row["ok"] and diff < 0.1 * top and same >= 0.9 and row[f"{label}_replay"] == "exact"
            row[f"{label}_diff"], row[f"{label}_same"] = diff, same
        out.append(row)
    del models
    torch.cuda.empty_cache()


def step_note(r: dict[str, object]) -> str:
    """The step row's other columns: the fused-prologue variant, replay checks and the logit checks vs base."""
    return (
        f"  | fused {r['fused_us']:.2f} | new/base {r['new_us'] / r['base_us']:.3f} | replays {r['new_replay']} / "
        f"{r['fused_replay']} | vs base: max diff {r['new_diff']:.3g} / {r['fused_diff']:.3g}, argmax same "
        f"{r['new_same']:.2f} / {r['fused_same']:.2f}"
    )


def print_gemm_tables(rows: list[dict[str, object]]) -> None:
    """Part 1's table, and the sweep's best configs as TUNED_CONFIGS lines to paste."""
    print(
        f"\n{'gemm':>8} {'M':>3} {'MB':>5} {'cuBLAS':>7} {'old':>7} {'new':>7} {'best':>7} {'TB/s':>5} ok  best config"
    )
    for r in rows:
        tbs = r["mb"] / r["best_us"]  # type: ignore[operator]  # MB / us = TB/s
        times = " ".join(f"{r[key]:>7.2f}" for key in ("cublas_us", "old_us", "new_us", "best_us"))
        flag = "ok" if r["ok"] else "WRONG"
        print(f"{r['gemm']:>8} {r['m']:>3} {r['mb']:>5.1f} {times} {tbs:>5.2f} {flag}  {r['best_cfg']}")
    print("\nTUNED_CONFIGS entries (N, K, rows bucket): SkinnyConfig(...), and whether it beats cuBLAS:")
    for r in rows:
        k, n = GEMMS[str(r["shape"])][str(r["gemm"])]
        beats = r["best_us"] < r["cublas_us"]  # type: ignore[operator]
        print(f"    ({n}, {k}, {r['m']}): SkinnyConfig{r['best_cfg']},  # {'BEATS_CUBLAS' if beats else 'fused only'}")


def print_tables(out: list[dict[str, object]]) -> None:
    """The results: per-kernel us, old vs new, and the sweep's best configs as a table to paste."""
    gemm_rows = [r for r in out if r["part"] == "gemm"]
    if gemm_rows:
        print_gemm_tables(gemm_rows)
    parts = ("norm_qkv", "norm_gate_up", "silu_down", "norm_rope_store", "decode", "step")
    for part, key in ((p, "b" if p in ("decode", "step") else "m") for p in parts):
        rows = [r for r in out if r["part"] == part]
        if rows:
            print(f"\n{part:>16} {key:>3} {'old us':>8} {'new us':>8} ok")
            for r in rows:
                extra = step_note(r) if part == "step" else ""
                old = r["base_us"] if part == "step" else r["old_us"]
                print(f"{'':>16} {r[key]:>3} {old:>8.2f} {r['new_us']:>8.2f} {'ok' if r['ok'] else 'WRONG'}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(GEMMS), default="0.6b")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts (decode batch sizes)")
    parser.add_argument("--sweep", action="store_true", help="also sweep skinny configs (sweep_small.py does more)")
    parser.add_argument("--no-step", action="store_true", help="skip the whole-step timing (part 4)")
    parser.add_argument("--json", default=None, help="append one JSON line per measurement here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_batch.py needs a CUDA GPU (it times kernels on the device)")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    start = time.perf_counter()
    out: list[dict[str, object]] = []
    bench_gemms(args.shape, rows, args.sweep, out)
    bench_norm_rope_store(args.shape, rows, out)
    bench_decode(args.shape, rows, out)
    print_tables(out)  # parts 1-3 now: part 4 builds whole models and could fail on its own
    if not args.no_step:
        step_rows: list[dict[str, object]] = []
        try:
            bench_step(args.shape, rows, step_rows)
        except Exception as e:  # the rows measured before it still print
            print(f"\npart 4 stopped: {type(e).__name__}: {str(e)[:200]}")
        print_tables(step_rows)
        out += step_rows
    print(f"\n(bench took {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "a") as f:
            for row in out:
                f.write(json.dumps(row, default=str) + "\n")


if __name__ == "__main__":
    main()
