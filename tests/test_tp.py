"""Tensor parallelism at world size 2 on the CPU (gloo), through the public LLM API: same greedy tokens as one
process, failures reported rather than hung on, no worker left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_models import write_family

from fnvllm.executor.tp import TensorParallelError
from fnvllm.executor.tp_ranks import Channel, Step, Stop
from fnvllm.llm import LLM
from fnvllm.state import InvalidConfigError, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# block_size 4 and 40 blocks: 6 sequences of up to 64 tokens need ~90 blocks, so some are preempted. The torch
# attention backend: CI's Triton runs interpreted on the CPU, 5x slower, and tests/test_kernels_* cover it.
OPTIONS: dict[str, Any] = dict(
    device="cpu", load_tokenizer=False, block_size=4, num_blocks=40, max_num_seqs=6, attention_backend="torch"
)
BOUND_S = 30.0  # a failure must surface within this


def prompts() -> list[list[int]]:
    """Six prompts sharing a 16-token prefix (prefix-cache hits), with distinct tails of 4-24 tokens."""
    shared = [(7 * i + 3) % 250 + 3 for i in range(16)]
    return [shared + [(11 * i + 5 * j) % 250 + 3 for i in range(4 + 4 * j)] for j in range(6)]


def greedy(llm: LLM) -> list[tuple[int, ...]]:
    """Greedy token ids of ``prompts()``."""
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def check_tp2_greedy(path: Path) -> LLM:
    """Greedy tokens of ``prompts()`` at tensor_parallel_size=2 equal one process's, with prefix-cache hits and
    preemptions (OPTIONS' small pool); returns the TP engine, still open, for more checks (the caller closes it)."""
    expected = greedy(LLM(path, **OPTIONS))
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        assert greedy(llm) == expected
        assert llm.stats.num_cached_tokens > 0
        assert llm.stats.num_preemptions > 0
    except BaseException:
        llm.close()
        raise
    return llm


def child_pids() -> set[int]:
    """Pids of this process's live children (from /proc, so zombies and strangers are not counted)."""
    me, pids = str(os.getpid()), set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            pids.add(int(entry.name))
    return pids


def within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` in a thread; fail the test if it has not returned after ``seconds``; return what it raised."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (hung)"
    return raised[0] if raised else None


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_tp2_greedy_equals_tp1(tmp_path: Path, family: str) -> None:
    """Greedy outputs at tensor_parallel_size=2 equal one process's, with prefix-cache hits and preemptions
    (qwen3 splits its 2 KV heads; qwen2 and llama replicate their single KV head)."""
    llm = check_tp2_greedy(write_family(tmp_path, family))
    try:
        [stats] = llm.executor.worker_stats()
        assert stats["steps"] == llm.stats.num_steps and stats["graphs"] is False
        assert llm.executor.worker_stats()[0]["steps"] == 0  # a report starts the count anew
    finally:
        llm.close()


def test_tp2_overlapped_steps_equal_tp1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapped steps under tensor parallelism (on the CPU only when forced: there launching is computing):
    each rank feeds a speculative step from the sampled ids rank 0 broadcast, a dropped step rewinds every
    rank, and the greedy tokens equal one process's, with prefix-cache hits. Eight prompts for
    six seats, and stop ids each row samples mid-run: a row that stops lets a waiting one in, which the
    speculative plan could not know (dropped)."""
    from fnvllm.engine.loop import EngineLoop
    from fnvllm.executor.tp import TensorParallelExecutor

    path = write_family(tmp_path, "qwen3")
    one = LLM(path, **OPTIONS)
    work = prompts() + prompts()[:2]
    probe = [o.token_ids for o in one.generate(work, GREEDY, use_tqdm=False)]
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(ids[8 + i],)) for i, ids in enumerate(probe)]
    expected = [o.token_ids for o in one.generate(work, params, use_tqdm=False)]
    monkeypatch.setattr(TensorParallelExecutor, "supports_overlap", property(lambda self: self.local.shares_samples))
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        llm.loop = EngineLoop(llm.engine)
        assert llm.loop.overlap
        assert [o.token_ids for o in llm.generate(work, params, use_tqdm=False)] == expected
        stats = llm.loop.overlap_stats
        assert stats.kept > 10 and stats.dropped > 0, stats
    finally:
        llm.close()


MESSAGE_SIZES = (10, 40_000, 3_000_000, 10, 200_000)  # characters of a seq id: one frame, two, past the cap, ...


def _channel_rank(rank: int, store_path: str, received: Any) -> None:
    """One rank of ``test_channel_frames``: rank 0 posts steps of the sizes above, rank 1 receives them."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    channel = Channel(dist.new_group(backend="gloo"))
    for size in MESSAGE_SIZES:
        plan = StepPlan(step=size, block_size=1, seq_ids=("x" * size,))
        if rank == 0:
            works, _ = channel.post(Step(plan))
            for work in works:
                work.wait()
        else:
            message = channel.receive()
            received.put((isinstance(message, Step) and message.plan == plan, size, channel.frame_bytes))
    if rank == 0:
        channel.post(Stop())[0][0].wait()
    else:
        assert isinstance(channel.receive(), Stop)
    dist.destroy_process_group()


def test_channel_frames(tmp_path: Path) -> None:
    """Control messages of any size arrive whole: small ones in one frame, larger ones in two broadcasts after
    which both ends widen the frame (capped at 1 MiB)."""
    ctx = mp.get_context("spawn")
    received = ctx.Queue()
    ranks = [ctx.Process(target=_channel_rank, args=(r, str(tmp_path / "store"), received)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    got = [received.get(timeout=5) for _ in MESSAGE_SIZES]
    assert [(whole, size) for whole, size, _ in got] == [(True, s) for s in MESSAGE_SIZES]
    assert [frame for *_, frame in got] == [16 << 10, 64 << 10, 1 << 20, 1 << 20, 1 << 20]


def test_killed_worker_is_a_clear_error(tmp_path: Path) -> None:
    """A worker killed mid-generation makes the step raise TensorParallelError naming it, within a bound, and
    every later call raises it too; closing then leaves no child process."""
    llm = LLM(write_family(tmp_path, "llama"), tensor_parallel_size=2, **OPTIONS)
    worker = llm.executor.ranks.processes[0]

    def generate_after_kill() -> None:
        for i, _ in enumerate(llm.stream(prompts(), GREEDY)):
            if i == 3:
                os.kill(worker.pid, signal.SIGKILL)

    error = within(BOUND_S, generate_after_kill)
    assert isinstance(error, TensorParallelError)
    assert f"worker rank 1 (pid {worker.pid})" in str(error)
    assert "SIGKILL" in str(error)
    again = within(BOUND_S, lambda: llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert isinstance(again, TensorParallelError)
    assert within(BOUND_S, llm.close) is None
    assert worker.pid not in child_pids()


def test_del_llm_leaves_no_child(tmp_path: Path) -> None:
    """Dropping the last reference to a tensor-parallel LLM stops its worker processes."""
    before = child_pids()
    llm = LLM(write_family(tmp_path, "qwen2"), tensor_parallel_size=2, **OPTIONS)
    workers = child_pids() - before
    assert workers
    del llm
    assert not workers & child_pids()


EXIT_SCRIPT = """
    import os, signal, sys, threading, time
    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams
    if __name__ == "__main__":
        # Ctrl-C as a terminal delivers it: a process started with SIGINT ignored (a background job of a
        # non-interactive shell, as a CI runner may launch the suite) keeps the ignore, and Python honours it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        llm = LLM(sys.argv[1], device="cpu", load_tokenizer=False, tensor_parallel_size=2, attention_backend="torch")
        print(llm.executor.ranks.processes[0].pid, flush=True)
        interrupt = sys.argv[2] == "interrupt"
        if interrupt:  # Ctrl-C in the middle of a generate call; each step slowed so the call outlasts the timer
            llm.loop.on_step = lambda *_: time.sleep(0.05)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        params = SamplingParams(max_tokens=1000 if interrupt else 8, ignore_eos=True)
        llm.generate([[5, 6, 7] * 20] * 4, params, use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_process_exit_leaves_no_worker(tmp_path: Path, how: str) -> None:
    """A script that exits without closing its LLM, or is interrupted with Ctrl-C, leaves no worker running."""
    path = write_family(tmp_path, "qwen3")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(path), how], capture_output=True, text=True, env=env, timeout=120
    )
    worker_pid = int(run.stdout.split()[0])
    assert run.returncode != 0 if how == "interrupt" else run.returncode == 0, run.stderr[-2000:]
    deadline = time.monotonic() + 5
    while Path(f"/proc/{worker_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{worker_pid}").exists()


def test_bad_tensor_parallel_size_is_rejected(tmp_path: Path) -> None:
    """tensor_parallel_size must be an int >= 1 and split the model's heads; errors come before any process."""
    path = write_family(tmp_path, "qwen3")
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0, **OPTIONS)
    before = child_pids()
    with pytest.raises(
        InvalidConfigError,
        match=r"^EngineConfig\.tensor_parallel_size: num_attention_heads \(4\) must be a multiple of tensor_parallel",
    ):
        LLM(path, tensor_parallel_size=3, **OPTIONS)
    assert child_pids() == before


def test_fp8_weights_that_cannot_split_on_scale_blocks_are_refused_before_any_process() -> None:
    """FP8 weights whose shards would not fall on 128-wide scale blocks (the demo model's 4 heads of 64 over 2
    ranks) are an InvalidConfigError naming tensor_parallel_size, before any worker starts (it surfaced from a
    worker, after the spawn, as a TensorParallelError)."""
    import fnvllm.demo

    before = child_pids()
    with pytest.raises(InvalidConfigError, match=r"^EngineConfig\.tensor_parallel_size=2: rank \d: FP8 weights"):
        LLM(fnvllm.demo.model_path(), tensor_parallel_size=2, quantization="fp8", device="cpu", num_blocks=16)
    assert child_pids() == before
