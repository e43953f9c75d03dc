"""Where a tensor-parallel decode step spends its time, and whether TP=2's greedy differences are near-ties.

One run on two GPUs (``nvidia-h200-x2``), each stage its own subprocess, a table last (~4-5 minutes):

1. comm: the link between the GPUs at the decode step's shapes: peer access, the transports NCCL chose, one
   all-reduce of (B, hidden) bf16 eagerly and inside a CUDA graph of as many as a step makes (2 per layer + 1),
   and the logits gather (B, V/2) to rank 0 beside an all-gather of the same bytes.
2. tp1: one LLM at TP=1 on a random checkpoint: (a) greedy reference of 64 prompts x 32 tokens with top-2
   logprobs; (b) the same prompts 8 at a time (TP=1 against itself under another batch composition: bf16 noise
   from GEMM shapes alone); (c) per-step profile of decode steps at each batch size (``--batches``).
3. tp2: the same at TP=2 (greedy with logprobs, profile, and the worker's own timing).
4. bench: ``fnvllm bench`` at TP=1 and TP=2, when the budget leaves room (``--skip-bench`` to leave it out).

Profile of one decode step (the mean over ``--steps`` steps after ``--warm`` ones, every sequence decoding):
host, rank 0: outside (schedule + commit + routing), send (pickle + post the plan), forward (input preparation,
copies, graph launch), logits (LM head + gather launch), sample (sampling inputs + sampler launch), wait (until
the step's tokens are computed), rest (token copy, logprobs). GPU (CUDA events on rank 0's stream): forward,
logits, sample, step (first to last), idle = wall - step. Worker: delivery (rank 0 post -> plan unpickled) and
execute (its host time to launch), beside rank 0's post -> logits launched.

Agreement: for each prompt where a run differs from the TP=1 reference, the reference's top-1 minus top-2 logprob
at the first differing position (the "margin"); a run is explained by near-ties when every prompt matches or first
differs at a margin below the tolerance. The tolerance is calibrated on TP=1 against itself (the largest margin
at which a batch-composition change alone flipped a token), beside the fixed 0.05 nats. Also the largest
|top-1 logprob difference| before the first difference: the size of the numerical error itself.

    PYTHONPATH=$PWD python3 benchmarks/tp_profile.py                     # on nvidia-h200-x2 (OUT=/tmp/out)
    python benchmarks/tp_profile.py --model-shape tiny --batches 8 --prompt-len 48 --steps 8 --num-prompts 16 \
        --tokens 8 --skip-bench                                          # CPU dry run (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # NVLink multicast stays off

from benchmarks.tp_phases import Phases, summarize  # noqa: E402

BUDGET_S = 290.0
LIMITS_S = {"checkpoint": 90, "comm": 60, "tp": 120, "bench": 100}
TOLERANCE = 0.05  # nats; compared with the calibrated one (see the module docstring)


# ---- stage 2/3: one LLM per TP size ---------------------------------------------------------------------------


def llm_options(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    """The engine options of the TP stages (the bench's block size and token budget; a fixed KV cache)."""
    return dict(
        load_tokenizer=False,
        tensor_parallel_size=tp,
        block_size=256,
        max_num_batched_tokens=16384,
        max_num_seqs=max(args.batches),
        max_model_len=2048,
        num_blocks=args.num_blocks,
    )


def greedy(llm: Any, prompts: list[list[int]], tokens: int, group: int) -> dict[str, Any]:
    """Greedy tokens and top-2 logprobs of ``prompts``, ``group`` prompts per generate call, from an empty cache."""
    from fnvllm.state import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    start, outs = time.perf_counter(), []
    for i in range(0, len(prompts), group):
        llm.loop.restore()  # forget cached prefixes: each call starts alike
        outs += llm.generate(prompts[i : i + group], params, use_tqdm=False)
    return {
        "tokens": [list(o.token_ids) for o in outs],
        "top": [[[list(pair) for pair in lp.top] for lp in o.logprobs] for o in outs],
        "seconds": round(time.perf_counter() - start, 2),
    }


def profile(llm: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per-step breakdown of ``args.steps`` decode steps with ``batch`` sequences (see the module docstring)."""
    import random

    from fnvllm.state import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.warm + args.steps + 1)
    for i in range(batch):
        llm.loop.add(f"profile-{batch}-{i}", [rng.randint(0, 10000) for _ in range(args.prompt_len)], params)
    while len(llm.loop.state.running) < batch or llm.loop.state.waiting:
        llm.loop.step()  # prefill
    for _ in range(args.warm):
        llm.loop.step()
    llm.loop.drain()  # the profiled steps run plainly: the phases are those of a step that waits for its tokens
    executor = llm.executor
    phases = Phases.attach(executor)
    if hasattr(executor, "worker_stats"):
        executor.worker_stats()  # start the workers' count here
    phases.run(lambda: plain_step(llm.loop), args.steps)
    record = summarize(phases, batch)
    if hasattr(executor, "worker_stats"):
        record["workers"] = executor.worker_stats()
    phases.detach()
    while llm.loop.has_unfinished:
        llm.loop.step()
    return record


def plain_step(loop: Any) -> None:
    """One step of ``loop`` run by hand, not overlapped (schedule, execute + commit, then ``EngineLoop.adopt``
    routes it): ``execute`` is called once and waits for the tokens, so the phases above time a whole step."""
    from fnvllm.state import schedule

    state, plan = schedule(loop.state)
    state, out = loop.engine.step(state, plan)
    loop.adopt(state, plan, out)


def tp_stage(args: argparse.Namespace) -> None:
    """Stage 2 or 3 in this process: build the LLM, run the greedy runs and the profiles, write JSON."""
    from fnvllm.llm import LLM
    from fnvllm.workloads import agreement_prompts

    tp = args.tp_stage
    start = time.perf_counter()
    record: dict[str, Any] = {}
    with LLM(args.folder, **llm_options(args, tp)) as llm:
        record["build_s"] = round(time.perf_counter() - start, 1)
        record["graphs"] = llm.executor.graphs is not None
        record["backend"] = llm.executor.backend.name
        prompts = agreement_prompts(args.num_prompts)
        record["greedy"] = greedy(llm, prompts, args.tokens, len(prompts))
        if tp == 1:
            record["greedy_by_8"] = greedy(llm, prompts, args.tokens, 8)
        record["profiles"] = [profile(llm, b, args) for b in args.batches]
    args.out.write_text(json.dumps(record))


# ---- stage 1: the link --------------------------------------------------------------------------------------


def comm_rank(rank: int, store: str, shapes: dict[str, int], batches: list[int], out: str) -> None:
    """One rank of the comm stage (NCCL on CUDA, gloo on the CPU); rank 0 writes the JSON record."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dtype = torch.bfloat16 if cuda else torch.float32
    record: dict[str, Any] = {"peer_access": cuda and torch.cuda.can_device_access_peer(0, 1), "rows": []}
    for b in batches:
        x = torch.randn(b, shapes["hidden"], dtype=dtype, device=device)
        logits = torch.randn(b, shapes["vocab"] // 2, dtype=dtype, device=device)
        row = {"batch": b, "all_reduce_us": _timed(lambda x=x: dist.all_reduce(x), device) * 1e3}
        if cuda:
            row["graph_all_reduce_us"] = _graph_all_reduces(x, shapes["all_reduces"]) * 1e3
        parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
        gather = lambda src=logits, dst=parts: dist.gather(src, dst, dst=0)  # noqa: E731
        row["gather_logits_us"] = _timed(gather, device) * 1e3
        joined = torch.empty(2 * b, logits.shape[1], dtype=dtype, device=device)  # (2B, V/2): both ranks' rows
        all_gather = lambda src=logits, dst=joined: dist.all_gather_into_tensor(dst, src)  # noqa: E731
        row["all_gather_logits_us"] = _timed(all_gather, device) * 1e3
        row["logits_mb"] = round(logits.numel() * logits.element_size() / 1e6, 1)
        record["rows"].append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def _timed(fn: Any, device: Any, repeat: int = 20) -> float:
    """Mean ms of ``fn`` after 3 warm-ups (CUDA events on the GPU)."""
    import torch

    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeat
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeat


def _graph_all_reduces(x: Any, count: int) -> float:
    """Mean ms of one all-reduce of ``x`` inside a CUDA graph of ``count`` of them (as a decode step replays)."""
    import torch
    import torch.distributed as dist

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            dist.all_reduce(x)
    return _timed(graph.replay, x.device, repeat=5) / count


def comm_stage(args: argparse.Namespace) -> None:
    """Stage 1 in this process: two ranks (spawned) time the collectives of a decode step."""
    import tempfile

    import torch.multiprocessing as mp

    from fnvllm.model.config import ModelConfig

    config = ModelConfig.from_pretrained(args.folder)
    shapes = {"hidden": config.hidden_size, "vocab": config.vocab_size, "all_reduces": 2 * config.num_hidden_layers + 1}
    store = tempfile.mktemp(prefix="fnvllm-comm-")
    mp.start_processes(comm_rank, args=(store, shapes, args.batches, str(args.out)), nprocs=2, start_method="spawn")
    record = json.loads(args.out.read_text())
    record["all_reduces_per_step"] = shapes["all_reduces"]
    args.out.write_text(json.dumps(record))


def nccl_transports(log: Path) -> str:
    """The transports NCCL reported (``via P2P/CUMEM``, ``via SHM``, ...) in a log made with NCCL_DEBUG=INFO."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = sorted(set(re.findall(r"NCCL INFO .*? via (\S+)", text)))
    return ", ".join(found) or "not reported"


def gpu_link() -> str:
    """The GPU0-GPU1 cell of ``nvidia-smi topo -m`` (NV# = NVLink, PIX/PXB/NODE/SYS = PCIe paths), if known."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi not available"
    row = next((line.split() for line in text.splitlines() if line.startswith("GPU0")), None)
    return row[2] if row and len(row) > 2 else "unknown"


# ---- the driver --------------------------------------------------------------------------------------------


def stage(name: str, argv: list[str], log: Path, deadline: float, env: dict[str, str] | None = None) -> str | None:
    """Run one subprocess within its limit and the budget; None when it succeeded, else a note."""
    limit = min(LIMITS_S[name], deadline - time.monotonic())
    if limit < 30:
        return "skipped: out of time"
    with log.open("w") as f:
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=limit, env=env).returncode
        except subprocess.TimeoutExpired:
            return f"timeout after {limit:.0f} s (log: {log})"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return None if rc == 0 else f"rc={rc}: " + " | ".join(lines[-4:])[-400:]


def main_run(args: argparse.Namespace, out_dir: Path) -> int:
    """All stages, then the table; 0 when every stage ran."""
    from benchmarks.tp_report import report
    from fnvllm.bench import write_checkpoint

    start = time.monotonic()
    deadline = start + args.budget_s
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = write_checkpoint(
        args.model_shape, Path(os.environ.get("TMPDIR", "/tmp")) / f"fnvllm-tp-{args.model_shape}"
    )
    notes = {"checkpoint": f"{args.model_shape}, written in {time.monotonic() - start:.0f} s", "link": gpu_link()}
    common = ["--folder", str(folder), "--batches", *map(str, args.batches)]
    common += ["--prompt-len", str(args.prompt_len), "--warm", str(args.warm), "--steps", str(args.steps)]
    common += [
        "--num-prompts",
        str(args.num_prompts),
        "--tokens",
        str(args.tokens),
        "--num-blocks",
        str(args.num_blocks),
    ]
    me = [sys.executable, __file__]
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    notes["comm"] = stage(
        "comm", [*me, "--comm-stage", "--out", str(out_dir / "comm.json"), *common], out_dir / "comm.log", deadline, env
    )
    notes["transports"] = nccl_transports(out_dir / "comm.log")
    for tp in (1, 2):
        argv = [*me, "--tp-stage", str(tp), "--out", str(out_dir / f"tp{tp}.json"), *common]
        notes[f"tp{tp}"] = stage("tp", argv, out_dir / f"tp{tp}.log", deadline)
    if not args.skip_bench:
        for tp in (1, 2):
            argv = [sys.executable, "-m", "fnvllm.cli", "bench", "--model", str(folder), "--json"]
            argv += ["--tensor-parallel-size", str(tp), "--max-num-seqs", str(max(256, *args.batches))]  # fewer graphs
            notes[f"bench{tp}"] = stage("bench", argv, out_dir / f"bench_tp{tp}.log", deadline)
    notes["total"] = f"{time.monotonic() - start:.0f} s"
    return report(out_dir, notes, TOLERANCE)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="qwen3-8b", help="checkpoint shape (tiny: a CPU dry run)")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256], help="decode batch sizes to profile")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each profiled sequence")
    p.add_argument("--warm", type=int, default=8, help="decode steps before the measured ones")
    p.add_argument("--steps", type=int, default=48, help="measured decode steps per batch size")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts of the agreement check")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per agreement prompt")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of 256 tokens (fixed: no sizing pass)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time budget")
    p.add_argument("--skip-bench", action="store_true", help="leave out the fnvllm bench pair")
    p.add_argument("--tp-stage", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--comm-stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.comm_stage:
        comm_stage(args)
        return 0
    if args.tp_stage is not None:
        tp_stage(args)
        return 0
    return main_run(args, Path(os.environ.get("OUT", "/tmp/out")))


if __name__ == "__main__":
    sys.exit(main())
