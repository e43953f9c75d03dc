"""Validate the simulator's step-time model against the real engine on the CPU (until the GPU log lands).

    OMP_NUM_THREADS=1 python examples/simulate_cpu_validation.py

1. Writes a small random Qwen3 checkpoint and runs the real engine (torch executor, CPU) on two different
   workloads with ``FNVLLM_TIMELINE`` set, so the engine logs every step's shape and measured time.
2. Fits a CPU profile to workload A's log (``fit_profile``, what ``fnvllm simulate calibrate`` does).
3. Predicts workload B's step times with it and prints predicted vs measured (total and per step).

The CPU "roofline" is crude (a CPU forward pass is not bandwidth- or FLOP-bound the way a GPU's is): the fitted
scale and per-step / per-sequence / per-token constants carry most of the prediction here. The simulator sees the
same plans as the engine (tests/test_sim_engine.py proves it), so the step model is the only source of error.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

from fnvllm.llm import LLM
from fnvllm.sim import HardwareProfile, fit_profile, load_shape, prediction_error, read_timeline
from fnvllm.state import SamplingParams
from fnvllm.testing.checkpoints import write_tiny_checkpoint

CPU = HardwareProfile(name="cpu-dev", mem_bandwidth_gbs=10.0, matmul_tflops=0.08, memory_gib=8.0, graph_max_seqs=0)
ENGINE = {"block_size": 16, "num_blocks": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 1024}
WORKLOADS = {  # name: (requests, prompt length range, output length range): short prompts vs long prompts
    "A": (64, (16, 400), (8, 64)),
    "B": (32, (100, 600), (4, 32)),
}


def run_engine(checkpoint: Path, name: str, log: Path) -> float:
    """Run workload ``name`` on the CPU engine with its timeline written to ``log``; returns the wall seconds."""
    num, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = random.Random(name)
    prompts = [[rng.randrange(1, 2000) for _ in range(rng.randint(p_lo, p_hi))] for _ in range(num)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(o_lo, o_hi)) for _ in range(num)]
    os.environ["FNVLLM_TIMELINE"] = str(log)
    llm = LLM(checkpoint, load_tokenizer=False, device="cpu", dtype="float32", **ENGINE)
    del os.environ["FNVLLM_TIMELINE"]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.executor.timeline.close()
    return wall


def main() -> None:
    """Calibrate on A, predict B, print the comparison (in a temporary folder, removed at the end)."""
    with tempfile.TemporaryDirectory(prefix="fnvllm-simval-") as tmp:
        validate(Path(tmp))


def validate(folder: Path) -> None:
    """Record A and B under ``folder``, fit on A, print each one's prediction error."""
    checkpoint = write_tiny_checkpoint(
        folder / "ckpt", "qwen3", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=768, vocab_size=2048,
    )  # fmt: skip
    model = load_shape(checkpoint)
    walls = {name: run_engine(checkpoint, name, folder / f"{name}.jsonl") for name in WORKLOADS}
    _, fit_records = read_timeline(folder / "A.jsonl")
    profile = fit_profile(fit_records, model, CPU, source="A.jsonl")
    print(f"fitted on A ({len(fit_records)} steps): {profile.eager}")
    for name in WORKLOADS:
        _, records = read_timeline(folder / f"{name}.jsonl")
        err = prediction_error(records, model, profile)
        role = "fit" if name == "A" else "predicted"
        print(
            f"{name} ({role}): {err['num_steps']} steps, measured {err['measured_s']:.3f} s (generate wall "
            f"{walls[name]:.3f} s), predicted {err['predicted_s']:.3f} s, total error {err['total_error']:+.1%}, "
            f"mean per-step error {err['mean_step_error']:.1%}"
        )


if __name__ == "__main__":
    main()
