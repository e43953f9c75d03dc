"""Probe (H200): does streaming the next weights into L2 on a side stream shorten a small-batch decode step?

    PYTHONPATH=$PWD python3 benchmarks/probe_l2_prefetch.py [--rows 1,16,64]

The whole Qwen3-0.6B decode step (28 layers + logits, one CUDA graph, the latency bench's contexts; as
``benchmarks/sweep_small.py --parts step``) is timed as it ships ("off") and with a side stream that, at each
layer's start, forks from the compute stream and runs one kernel of bulk L2 prefetches
(``cp.async.bulk.prefetch.L2``, 16 KiB each) over the layer's weights, joined back at the end of the forward:
"layer" = this layer's o / gate_up / down and the next layer's qkv, "mlp" = gate_up / down, "attn" = o / gate_up /
down; the number is the prefetch kernel's programs. Logits are compared with the shipped step's (a prefetch
changes no value). Measured 2026-12-02 (BENCHMARKS.md, "Sixth session"): slower in every variant, so the engine
does not do it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

CHUNK = 16384
MODE: dict[str, object] = {"mode": "off", "grid": 32}


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Bulk L2 prefetches of four byte ranges (n_i bytes from p_i, whole CHUNKs), spread over the programs."""
    pid, num = tl.program_id(0), tl.num_programs(0)
    lane = tl.arange(0, LANES)
    for t in tl.static_range(4):
        base = p0 if t == 0 else (p1 if t == 1 else (p2 if t == 2 else p3))
        nbytes = n0 if t == 0 else (n1 if t == 1 else (n2 if t == 2 else n3))
        chunks = nbytes // CHUNK
        for c0 in range(pid * LANES, chunks, num * LANES):
            c = c0 + lane
            ptrs = base + tl.where(c < chunks, c, 0).to(tl.int64) * CHUNK
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                [ptrs, tl.full([LANES], CHUNK, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip


def prefetch(weights: list[torch.Tensor], grid: int) -> None:
    """One launch prefetching up to four weights into L2."""
    args: list[object] = []
    for w in weights[:4]:
        args += [w.view(torch.uint8).view(-1), w.numel() * w.element_size() // CHUNK * CHUNK]
    while len(args) < 8:
        args += [args[0], 0]
    _prefetch_kernel[(grid,)](*args, CHUNK=CHUNK, LANES=16, num_warps=1)


def layer_weights(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """(qkv, o, gate_up, down) weights of a decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight


def patch_forward() -> None:
    """DecoderModel.forward with the side-stream prefetches of MODE (the shipped forward when "off")."""
    from fnvllm.model import models

    shipped = models.DecoderModel.forward
    side = torch.cuda.Stream()

    def forward(self, input_ids, positions, kv_caches, meta, backend):  # type: ignore[no-untyped-def]
        if MODE["mode"] == "off":
            return shipped(self, input_ids, positions, kv_caches, meta, backend)
        main = torch.cuda.current_stream()
        rope = self.rotary_emb(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        layers = list(self.layers)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            _, o, gate_up, down = layer_weights(layer)
            chosen = {"layer": [o, gate_up, down], "mlp": [gate_up, down], "attn": [o, gate_up, down]}[MODE["mode"]]
            if MODE["mode"] == "layer" and i + 1 < len(layers):
                chosen.append(layer_weights(layers[i + 1])[0])
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(chosen, int(MODE["grid"]))
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta, backend)
        main.wait_stream(side)
        return self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)[0]

    models.DecoderModel.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_l2_prefetch.py needs a CUDA GPU")
    from bench_small_batch import build_models, graph_time_us, run_step, step_inputs
    from sweep_small import LATENCY_CONTEXT

    from fnvllm.kernels.backends import get_backend

    patch_forward()
    model = build_models("0.6b", {"triton"})["triton"]
    backend = get_backend("triton")
    print("B  mode grid  us/step  same-logits")
    for b in (int(r) for r in args.rows.split(",")):
        ids, caches, meta = step_inputs(model, b, LATENCY_CONTEXT)
        step = functools.partial(run_step, model, ids, caches, meta, backend)
        MODE.update(mode="off")
        ref = step(0).float()
        for mode, grid in (("off", 0), ("layer", 16), ("layer", 64), ("mlp", 32), ("attn", 32), ("off", 0)):
            MODE.update(mode=mode, grid=grid)
            same = torch.equal(step(0).float(), ref)
            print(f"{b:<3} {mode:5} {grid:4} {graph_time_us(step, 1, repeats=20):8.1f}  {same}", flush=True)


if __name__ == "__main__":
    main()
