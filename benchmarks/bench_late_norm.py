"""The residual add + RMSNorm fused into the projection after it, three ways, at decode row counts (H200).

    PYTHONPATH=$PWD python3 benchmarks/bench_late_norm.py [--rows 1,16,64]

For Qwen3-0.6B's norm + qkv (4096 x 1024) and norm + gate/up (6144 x 1024) products, device us per call over CUDA
graph replays (weights rotated over 8 copies, past the 50 MB L2) of: ``unfused`` (``fused_ops.fused_add_rmsnorm``
then ``skinny_gemm.linear``, what runs when nothing is fused), ``early`` (the skinny kernel's statistics-first
norm prologue at ``fused_config("norm")``), ``late`` (``late_norm``: the row scale at the end, at the plain
product's tuned config). Each fused output is checked against the unfused one (max |diff| / max |y|), and the
residual stream it writes against x + residual exactly. A table last.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_small_batch import graph_time_us
from fnvllm.kernels import fused_ops, skinny_gemm
from fnvllm.kernels.skinny_gemm import Norm, SkinnyConfig, skinny_linear

SHAPES = {"qkv": (4096, 1024), "gate_up": (6144, 1024)}
COPIES = 8


def measure(m: int, name: str, n: int, k: int, gen: torch.Generator) -> dict:
    """One (rows, product) row of the table: times, errors and the configs used."""
    ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / 32 for _ in range(COPIES)]
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    res = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    nw = torch.rand(k, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    res_out = torch.empty_like(x)
    normed, expect_res = fused_ops.fused_add_rmsnorm(x, res, nw, 1e-6)
    want = skinny_gemm.linear(normed, ws[0], None)
    early_cfg = skinny_gemm.fused_config("norm", m, n, k) or skinny_gemm.skinny_config(m, n, k)
    tuned = skinny_gemm.tuned_config(m, n, k) or skinny_gemm.skinny_config(m, n, k)
    late_cfg = tuned._replace(late_norm=True) if tuned.split_k == 1 else None
    row: dict = {"m": m, "shape": name, "early_cfg": early_cfg, "late_cfg": late_cfg}
    candidates = [("early", early_cfg), ("late", late_cfg)]
    if m > 1:  # configs that compile without register spills with the late norm (sm_90, offline ptxas)
        candidates += [
            (f"late_w8_k128_{'pre' if pre else 's3'}_n{bn}", SkinnyConfig(m, bn, 128, 1, 8, 1 if pre else 3,
                                                                           preload=pre, late_norm=True))
            for bn, pre in ((32, True), (32, False), (64, False))
        ]  # fmt: skip

    def unfused(i: int) -> object:
        return skinny_gemm.linear(fused_ops.fused_add_rmsnorm(x, res, nw, 1e-6)[0], ws[i % COPIES], None)

    row["unfused"] = graph_time_us(unfused, 32)
    for label, cfg in candidates:
        if cfg is None:
            continue

        def fused(i: int, cfg: skinny_gemm.SkinnyConfig = cfg) -> object:
            return skinny_linear(x, ws[i % COPIES], None, cfg, norm=Norm(nw, 1e-6, res, res_out))

        got = fused(0)
        row[f"{label}_err"] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        row[f"{label}_res_exact"] = bool(torch.equal(res_out, expect_res))
        row[label] = graph_time_us(fused, 32)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_late_norm.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            table.append(measure(m, name, n, k, gen))
            print(table[-1], flush=True)
    spills = set()
    for cache in skinny_gemm._skinny_kernel.device_caches.values():
        for kernel in cache[0].values():
            spills.add((getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)))
    print("skinny kernel variants (n_regs, n_spills):", sorted(spills, key=str))
    print("| rows | product | unfused us | fused variant: us (rel err, residual exact) |")
    print("|---|---|---|---|")
    for r in table:
        cells = [
            f"{key} {r[key]:.2f} ({r[key + '_err']:.1e}, {r[key + '_res_exact']})"
            for key in r
            if key.startswith(("early", "late")) and isinstance(r[key], float) and not key.endswith("_err")
        ]
        print(f"| {r['m']} | {r['shape']} | {r['unfused']:.2f} | {'; '.join(cells)} |")


if __name__ == "__main__":
    main()
