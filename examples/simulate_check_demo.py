"""Record a run of the embedded demo model, fit a profile to it, and check the simulator against it (CPU).

    OMP_NUM_THREADS=1 python examples/simulate_check_demo.py [--out DIR]

1. Runs the demo model on two workloads with ``FNVLLM_TIMELINE`` set and a ``RunRecorder`` on the engine loop
   (the timeline has each step's device and host times; the run record the requests, configuration and steps).
2. ``fnvllm simulate calibrate A.jsonl``: a profile named after the device ("cpu"), recording the demo model.
3. ``fnvllm simulate --check B.jsonl --hardware profile.json``: B replayed in the simulator, end-to-end and
   per-step error. On a busy 2-core machine CPU step times are noisy; on a GPU the same recipe validates a
   profile (see docs/simulator.md).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from fnvllm.cli import main as fnvllm
from fnvllm.demo import model_path
from fnvllm.llm import LLM
from fnvllm.sim.recorder import RunRecorder, run_path
from fnvllm.state import SamplingParams

WORKLOADS = {"A": (24, (5, 120), (4, 48)), "B": (12, (40, 200), (4, 24))}  # requests, prompt and output ranges


def record(name: str, folder: Path) -> Path:
    """Run workload ``name`` on the demo model with a timeline and a run record; returns the timeline's path."""
    num, prompt_range, output_range = WORKLOADS[name]
    timeline = folder / f"{name}.jsonl"
    os.environ["FNVLLM_TIMELINE"] = str(timeline)
    llm = LLM(model_path(), num_blocks=256, load_tokenizer=False)
    del os.environ["FNVLLM_TIMELINE"]
    rng = random.Random(name)
    prompts = [[rng.randrange(4, 4000) for _ in range(rng.randint(*prompt_range))] for _ in range(num)]
    params = [SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True) for _ in prompts]
    recorder = RunRecorder(llm.engine.config, llm.loop.overlap, "cpu", model_name="fnvllm-demo")
    llm.loop.on_step = recorder.on_step
    recorder.arrive(prompts, [p.max_tokens for p in params])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    recorder.finish([len(o.token_ids) for o in outputs])
    recorder.write(run_path(timeline))
    llm.executor.timeline.close()
    return timeline


def main() -> None:
    """Record A and B, calibrate on A, check B."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for the timelines and the profile (default: temporary)")
    out = parser.parse_args().out
    if out is None:
        with tempfile.TemporaryDirectory(prefix="fnvllm-check-") as tmp:  # removed at the end
            check(Path(tmp))
    else:
        Path(out).mkdir(parents=True, exist_ok=True)
        check(Path(out))


def check(folder: Path) -> None:
    """Record A and B under ``folder``, calibrate on A, check B."""
    a, b = record("A", folder), record("B", folder)
    profile = folder / "profile.json"
    fnvllm(["simulate", "calibrate", str(a), "--out", str(profile), "--check", str(b)])
    fnvllm(["simulate", "--check", str(b), "--hardware", str(profile)])


if __name__ == "__main__":
    main()
