"""Tensor parallelism on two GPUs: TP=2 against TP=1 on a random Qwen3-8B-shape checkpoint (bf16), then throughput.

1. Greedy agreement: 64 prompts (every fourth shares a 300-token prefix), 32 tokens each, TP=1 vs TP=2 (CUDA graphs
   on, the default path); passes when >= 95 % of prompts agree on all 32 tokens. If TP=2 fails to run with graphs,
   TP=2 eager is tried too, to tell a graph-capture problem from a sharding one.
2. ``fnvllm bench --model <the same checkpoint>`` at TP=1 and TP=2 (issue target: TP=2 >= 1.7x TP=1).

Every run is its own subprocess (a clean GPU each time); each stage has a time limit so the whole check ends within
~9 minutes, and a short table prints last. Logs and JSON go to $OUT (default /tmp/out).

    python benchmarks/tp_check.py                                          # on nvidia-h200-x2
    python benchmarks/tp_check.py --model-shape tiny --bench-requests 4    # plumbing dry run, any machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # NVLink multicast stays off

BUDGET_S = 530.0  # the whole check
LIMITS_S = {"checkpoint": 150, "greedy": 150, "bench": 200}


def greedy_run(folder: Path, tp: int, eager: bool, out: Path) -> None:
    """One stage: greedy tokens of ``agreement_prompts()`` at tensor_parallel_size ``tp``, as JSON in ``out``."""
    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams
    from fnvllm.workloads import agreement_prompts

    options = dict(block_size=16, max_model_len=2048, max_num_seqs=64, num_blocks=4096, enforce_eager=eager)
    start = time.perf_counter()
    with LLM(folder, load_tokenizer=False, tensor_parallel_size=tp, **options) as llm:
        built = time.perf_counter()
        outs = llm.generate(
            agreement_prompts(), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
        )
        record = {
            "tokens": [list(o.token_ids) for o in outs],
            "build_s": round(built - start, 1),
            "generate_s": round(time.perf_counter() - built, 2),
            "graphs": llm.executor.graphs is not None,
            "cached_tokens": llm.stats.num_cached_tokens,
        }
    out.write_text(json.dumps(record))


def stage(name: str, argv: list[str], log: Path, deadline: float) -> tuple[bool, str]:
    """Run one subprocess within its limit and the overall budget; (ok, last lines of its output)."""
    limit = min(LIMITS_S[name], deadline - time.monotonic())
    if limit < 30:
        return False, "skipped: out of time"
    with log.open("w") as f:
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = "\n".join(line for line in log.read_text().splitlines()[-6:] if "Loading" not in line)
    return rc == 0, tail if rc == 0 else f"rc={rc if rc is not None else f'timeout {limit:.0f} s'}\n{tail}"


def greedy(folder: Path, tp: int, eager: bool, out_dir: Path, deadline: float) -> tuple[dict | None, str]:
    """The greedy stage for ``tp`` in a subprocess: (its record or None, a note)."""
    label = f"greedy_tp{tp}{'_eager' if eager else ''}"
    out = out_dir / f"{label}.json"
    argv = [sys.executable, __file__, "--greedy-run", str(tp), "--folder", str(folder), "--out", str(out)]
    ok, tail = stage("greedy", [*argv, *(["--eager"] if eager else [])], out_dir / f"{label}.log", deadline)
    return (json.loads(out.read_text()) if ok else None), tail


def bench(folder: Path, tp: int, requests: int, out_dir: Path, deadline: float) -> tuple[dict | None, str]:
    """``fnvllm bench`` at ``tp`` on the checkpoint: (its JSON record or None, a note)."""
    argv = [sys.executable, "-m", "fnvllm.cli", "bench", "--model", str(folder), "--json"]
    argv += ["--num-requests", str(requests)]
    log = out_dir / f"bench_tp{tp}.log"
    ok, tail = stage("bench", [*argv, "--tensor-parallel-size", str(tp)], log, deadline)
    if not ok:
        return None, tail
    # the JSON record is the last line that is one; warnings at interpreter exit may follow it
    record = json.loads(next(ln for ln in reversed(log.read_text().splitlines()) if ln.startswith("{")))
    (out_dir / f"bench_tp{tp}.json").write_text(json.dumps(record))
    return record, ""


def agreement(a: dict, b: dict) -> float:
    """Fraction of prompts whose 32 greedy tokens are identical in both records."""
    pairs = list(zip(a["tokens"], b["tokens"], strict=True))
    return sum(x == y for x, y in pairs) / len(pairs)


def main_check(shape: str, requests: int, out_dir: Path) -> int:
    """The whole check; prints the table last; 0 when agreement passes and both benches ran."""
    from fnvllm.bench import write_checkpoint

    deadline = time.monotonic() + BUDGET_S
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    folder = write_checkpoint(shape, Path(os.environ.get("TMPDIR", "/tmp")) / f"fnvllm-tp-{shape}")
    rows = [(f"checkpoint {shape} (random)", f"written in {time.monotonic() - start:.0f} s")]
    ref, note1 = greedy(folder, 1, False, out_dir, deadline)
    tp2, note2 = greedy(folder, 2, False, out_dir, deadline)
    ok = ref is not None and tp2 is not None and agreement(ref, tp2) >= 0.95
    rows.append(("greedy TP=1 (graphs)", _greedy_cell(ref, note1)))
    rows.append(("greedy TP=2 (graphs)", _greedy_cell(tp2, note2)))
    if ref is not None and tp2 is not None:
        rows.append(("TP=2 == TP=1, 32 tokens, 64 prompts", f"{agreement(ref, tp2):.1%} {'PASS' if ok else 'FAIL'}"))
    elif tp2 is None:
        eager, note = greedy(folder, 2, True, out_dir, deadline)
        rows.append(("greedy TP=2 (eager, diagnosis)", _greedy_cell(eager, note)))
        if ref is not None and eager is not None:
            rows.append(("TP=2 eager == TP=1", f"{agreement(ref, eager):.1%}"))
    benches = [bench(folder, tp, requests, out_dir, deadline) for tp in (1, 2)]
    for tp, (record, note) in zip((1, 2), benches, strict=True):
        rows.append((f"bench {shape} TP={tp}", _bench_cell(record, note)))
    if benches[0][0] and benches[1][0]:
        speedup = benches[1][0]["tok_per_s"] / benches[0][0]["tok_per_s"]
        rows.append(("TP=2 / TP=1 throughput", f"{speedup:.2f}x (target >= 1.7x)"))
    ok = ok and all(record is not None for record, _ in benches)
    _print_table([*rows, ("total", f"{time.monotonic() - start:.0f} s, {'PASS' if ok else 'FAIL'}")])
    return 0 if ok else 1


def _greedy_cell(record: dict | None, note: str) -> str:
    if record is None:
        return "FAILED: " + note.replace("\n", " | ")[-400:]
    return f"built {record['build_s']} s, 64 prompts in {record['generate_s']} s, graphs={record['graphs']}"


def _bench_cell(record: dict | None, note: str) -> str:
    if record is None:
        return "FAILED: " + note.replace("\n", " | ")[-400:]
    keys = ("tok_per_s", "seconds", "output_tokens", "fraction_of_floor", "cuda_graphs", "num_blocks", "preemptions")
    return ", ".join(f"{k}={record[k]}" for k in keys if k in record)  # no floor fields on a CPU dry run


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}} | {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--greedy-run", type=int, default=None, help="run one greedy stage at this TP size")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--model-shape", default="qwen3-8b", help="checkpoint shape (tiny: a quick dry run)")
    parser.add_argument("--bench-requests", type=int, default=256, help="requests in each bench run")
    args = parser.parse_args()
    if args.greedy_run is not None:
        greedy_run(args.folder, args.greedy_run, args.eager, args.out)
        return 0
    return main_check(args.model_shape, args.bench_requests, Path(os.environ.get("OUT", "/tmp/out")))


if __name__ == "__main__":
    sys.exit(main())
