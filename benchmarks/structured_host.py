"""Host cost per step of grammar-constrained rows: the mask fill and the token accept, on the CPU only.

python benchmarks/structured_host.py                         # 64 rows, 151,936-token vocabularies, 64 steps
python benchmarks/structured_host.py --rows 8 --steps 8 --vocab 4096 --threads 1

R matchers of bench_structured.py's long JSON schema walk the grammar for --steps steps; each step every row takes
a random token its mask allows (numpy, not timed). Per step it times, in milliseconds:

- fill, one by one: ``fill_next_token_bitmask`` per row on the calling thread (the naive path);
- fill, batched: ``Grammars.masks`` (one xgrammar batch call on W x T threads into one buffer laid out for a
  single upload; the executor's path for a step whose rows were not fed by the step in flight);
- accept: ``Grammars.accept`` of the step's tokens (one xgrammar batch call);
- accept+fill past host work: ``Grammars.advance`` (the overlapped path: accept the tokens, then fill the next
  step's masks, on W grammar worker threads, each its chunk of the rows with T xgrammar threads), then
  --host-ms of Python work (standing for the engine loop's commit and planning, which run meanwhile), then
  ``Grammars.wait``: the time past --host-ms is what the grammar work adds to the host's critical path.

A thread spec pWxT times the grammar process instead (``Grammars(process=True)``: W worker threads there, T
xgrammar threads in all): "fill, batched" is a mask asked for and waited for at once (with the step's accepts
sent before it), "accept+fill past host work" the same advance / host work / wait; the one-by-one fill and the
accept alone do not apply (nan).

The vocabularies are bench_structured.py's (``--vocabulary``: its BPE one learned from the standard library and padded
with multilingual tokens, its synthetic worst case of random JSON-ish strings, or both, the default) unless --model
names a checkpoint folder with a tokenizer. Needs xgrammar; without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_structured's schema and vocabulary

from bench_structured import LONG_SCHEMA, VOCABS


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="constrained rows")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's by default)")
    p.add_argument("--vocabulary", choices=[*VOCABS, "both"], default="both", help="bench_structured.py's vocabulary")
    p.add_argument("--model", default=None, help="a checkpoint folder whose tokenizer to use instead")
    p.add_argument("--threads", default="1,auto,4x4,p1xauto",
                   help="comma-separated fill thread counts ('auto': default_fill_threads()); WxT: W grammar "
                   "workers (each its chunk of rows) of T xgrammar threads; pWxT: in a grammar process")  # fmt: skip
    p.add_argument("--host-ms", type=float, default=2.0, help="host work the fill runs behind")
    return p.parse_args()


def _grammars(args: argparse.Namespace, vocab: str, threads: int, workers: int = 1) -> Any:
    """A Grammars over bench_structured.py's ``vocab`` vocabulary (or --model's tokenizer)."""
    import xgrammar as xgr

    from fnvllm.executor.structured import Grammars

    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], num_threads=threads, num_workers=workers)
    size = args.vocab
    info = xgr.TokenizerInfo(VOCABS[vocab](size), xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[0])
    return Grammars(None, size, [0], tokenizer_info=info, num_threads=threads, num_workers=workers)


WARMUP = 2  # untimed steps before the timed ones


def _busy(ms: float) -> None:
    """Pure-Python work for ``ms`` milliseconds (it holds the GIL, as commit and planning do)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        sum(range(200))


def _walk(args: argparse.Namespace, vocab: str, threads: int, workers: int) -> dict[str, float]:
    """Milliseconds per step of each timed part (module docstring)."""
    import xgrammar as xgr

    from fnvllm.executor.structured import Matcher
    from fnvllm.state import StructuredOutput

    grammars = _grammars(args, vocab, threads * workers, workers)
    compiled = grammars._compile(StructuredOutput.json_schema(LONG_SCHEMA))
    matchers = [Matcher(xgr.GrammarMatcher(compiled)) for _ in range(args.rows)]
    twins = [Matcher(xgr.GrammarMatcher(compiled)) for _ in range(args.rows)]  # accept inline, timed alone
    ids = [f"r{i}" for i in range(args.rows)]
    one_by_one = xgr.allocate_token_bitmask(args.rows, grammars.vocab_size)
    rng = np.random.default_rng(0)
    totals = dict.fromkeys(("fill, one by one", "fill, batched", "accept", "accept+fill past host work"), 0.0)
    host = grammars.masks(matchers)
    for step in range(-WARMUP, args.steps):
        if step == 0:  # the first steps start the threads: not timed
            totals = dict.fromkeys(totals, 0.0)
        start = time.perf_counter()
        for row, live in enumerate(matchers):
            live.matcher.fill_next_token_bitmask(one_by_one, row)
        totals["fill, one by one"] += time.perf_counter() - start
        start = time.perf_counter()
        host = grammars.masks(matchers)
        totals["fill, batched"] += time.perf_counter() - start
        if not np.array_equal(host.bitmask.numpy(), one_by_one.numpy()):
            raise SystemExit("structured_host: the batched fill differs from the per-row fills")
        tokens = _pick(host.bitmask.numpy(), grammars.vocab_size, rng)
        start = time.perf_counter()
        grammars.accept(ids, twins, tokens)
        totals["accept"] += time.perf_counter() - start
        start = time.perf_counter()
        pending = grammars.advance(ids, matchers, tokens, matchers)
        _busy(args.host_ms)
        grammars.wait(pending)
        totals["accept+fill past host work"] += time.perf_counter() - start - args.host_ms / 1e3
    return {name: 1e3 * total / args.steps for name, total in totals.items()}


def _walk_process(args: argparse.Namespace, vocab: str, threads: int, workers: int) -> dict[str, float]:
    """Milliseconds per step of the grammar process's parts (module docstring, pWxT)."""
    import xgrammar as xgr

    from fnvllm.state import StructuredOutput

    size = args.vocab
    info = xgr.TokenizerInfo(VOCABS[vocab](size), xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[0])
    before = os.sched_getaffinity(0)
    grammars = _grammars_process(args, info, threads, workers)
    process = grammars._process()
    if process.cores is not None:  # this thread on the engine loop's share, as in an engine (a table run may not be)
        os.sched_setaffinity(0, process.cores[0])
    matchers = [process.new(StructuredOutput.json_schema(LONG_SCHEMA)) for _ in range(args.rows)]
    ids = [f"r{i}" for i in range(args.rows)]
    rng = np.random.default_rng(0)
    nan = float("nan")
    totals = {"fill, one by one": nan, "fill, batched": 0.0, "accept": nan, "accept+fill past host work": 0.0}
    for step in range(-WARMUP, args.steps):
        if step == 0:
            totals |= {"fill, batched": 0.0, "accept+fill past host work": 0.0}
        start = time.perf_counter()
        host = grammars.masks(matchers)
        totals["fill, batched"] += time.perf_counter() - start
        tokens = _pick(host.bitmask.numpy(), size, rng)
        start = time.perf_counter()
        pending = grammars.advance(ids, matchers, tokens, matchers)
        _busy(args.host_ms)
        host = grammars.wait(pending)
        totals["accept+fill past host work"] += time.perf_counter() - start - args.host_ms / 1e3
        grammars.accept(ids, matchers, _pick(host.bitmask.numpy(), size, rng))  # sent with the next mask
    grammars.close()
    os.sched_setaffinity(0, before)
    return {name: 1e3 * total / args.steps for name, total in totals.items()}


def _grammars_process(args: argparse.Namespace, info: object, threads: int, workers: int) -> object:
    """A Grammars whose matchers live in a grammar process (W workers, T xgrammar threads in all)."""
    from fnvllm.executor.structured import Grammars

    return Grammars(None, args.vocab, [0], tokenizer_info=info, num_threads=threads * workers, num_workers=workers,
                    process=True)  # fmt: skip


def _pick(bitmask: np.ndarray, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """A random allowed token per row of an (R, W) int32 bitmask."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # (R, V)
    return [int(rng.choice(np.flatnonzero(row))) for row in bits]


def _spec(text: str, auto: int) -> str:
    """A --threads entry as [p]WxT ("auto" and a bare T: one worker; "auto" threads: ``auto``)."""
    process, text = text.startswith("p"), text.removeprefix("p")
    workers, threads = text.split("x") if "x" in text else ("1", text)
    return f"{'p' if process else ''}{workers}x{auto if threads == 'auto' else threads}"


def main() -> int:
    """Walk the grammar per thread count; print a table last."""
    args = _args()
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("structured_host: xgrammar is not installed (pip install xgrammar); skipped.")
        return 0
    from fnvllm.executor.structured import default_fill_threads

    specs = [_spec(t, default_fill_threads()) for t in args.threads.split(",")]
    vocabs = ["tokenizer"] if args.model else list(VOCABS) if args.vocabulary == "both" else [args.vocabulary]
    results = {}
    for vocab in vocabs:
        for spec in dict.fromkeys(specs):
            workers, threads = map(int, spec.removeprefix("p").split("x"))
            if spec.startswith("p") and not args.model:
                results[vocab, spec] = _walk_process(args, vocab, threads, workers)
            elif not spec.startswith("p"):
                results[vocab, spec] = _walk(args, vocab, threads, workers)
    names = list(next(iter(results.values())))
    print(f"\n{args.rows} constrained rows (long JSON schema), {args.steps} steps, vocabulary size {args.vocab}")
    print(f"{'vocabulary':>12}{'workers x threads':>18}" + "".join(f"{name + ' ms':>30}" for name in names))
    for (vocab, spec), row in results.items():
        label = args.model or vocab
        print(f"{label:>12}{spec:>18}" + "".join(f"{row[name]:>30.3f}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
