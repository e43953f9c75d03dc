"""Cost of grammar-constrained rows in a batch: a mix (default 25 % JSON-schema rows) against the same batch all
unconstrained, in one run, plus a correctness check (constrained outputs parse and satisfy their schema).

python benchmarks/bench_structured.py                       # H200: random Qwen3-0.6B, 256 rows, 25 % constrained
python benchmarks/bench_structured.py --model PATH          # a checkpoint folder (its tokenizer, if it has one)
python benchmarks/bench_structured.py --device cpu --model-shape demo --rows 32 --fraction 0.5 --max-tokens 32

Without a tokenizer (the random checkpoints) the grammars use a synthetic vocabulary of the model's size (byte
tokens plus random JSON-ish strings of 2-8 bytes), so the mask work is that of a real vocabulary's size.

Every row generates exactly --max-tokens tokens in both runs: unconstrained rows ignore EOS, constrained rows
follow a schema that cannot end sooner (an array of at least 10,000 objects), so the two runs do the same work
apart from the masks. Needs xgrammar (``pip install xgrammar``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LONG_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"],
    },
    "minItems": 10000,
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["c", "f", "k"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "unit", "ok"],
    "additionalProperties": False,
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: a random --model-shape checkpoint)")
    p.add_argument("--model-shape", default="qwen3-0.6b", help='"qwen3-0.6b", "tiny", or "demo" (the demo model)')
    p.add_argument("--device", default="auto")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--fraction", type=float, default=0.25, help="share of constrained rows in the mix")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each batch (the best is reported)")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                   help="also time both batches with overlapped steps off (default on)")  # fmt: skip
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the mix with deferred steps sampled at collect (default on)")  # fmt: skip
    p.add_argument("--host-steps", type=int, default=32, help="steps of the host-cost table (0: none)")
    p.add_argument("--fill-threads", type=int, default=None, help="xgrammar's fill threads (default: cores - 1)")
    return p.parse_args()


@contextlib.contextmanager
def _checkpoint(args: argparse.Namespace) -> Iterator[Path]:
    if args.model:
        yield Path(args.model)
        return
    if args.model_shape == "demo":
        from fnvllm.demo import model_path

        yield model_path()
        return
    from fnvllm.bench import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="fnvllm-bench-structured-") as tmp:
        print(f"writing a random {args.model_shape} checkpoint to {tmp}", file=sys.stderr, flush=True)
        yield write_checkpoint(args.model_shape, Path(tmp))


def _synthetic_vocab(size: int) -> list[bytes]:
    """Byte tokens, then random strings of JSON-ish characters (2-8 bytes), ``size`` in all."""
    rng = random.Random(0)
    alphabet = b'abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]":,._-'
    vocab = [bytes([i]) for i in range(256)]
    while len(vocab) < size:
        vocab.append(bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 8))))
    return vocab


def _build(args: argparse.Namespace, folder: Path) -> tuple[Any, Any]:
    """(the LLM, a decode function of token ids) with grammars attached."""
    import xgrammar as xgr

    from fnvllm.engine.text import has_tokenizer_files
    from fnvllm.executor.structured import Grammars
    from fnvllm.llm import LLM

    has_tokenizer = has_tokenizer_files(folder)
    options: dict[str, Any] = {"device": args.device, "max_num_seqs": args.rows, "enable_prefix_caching": False}
    if args.device == "cpu":
        options |= {"dtype": "float32", "attention_backend": "torch"}
    llm = LLM(folder, load_tokenizer=has_tokenizer, **options)
    if has_tokenizer:
        grammars = getattr(llm.executor, "local", llm.executor).grammars
        if grammars is not None and args.fill_threads:
            grammars.num_threads = args.fill_threads
        return llm, lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)
    vocab_size = llm.model_config.vocab_size
    eos = sorted(llm.engine.config.eos_token_ids)
    vocab = _synthetic_vocab(vocab_size)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos)
    executor = getattr(llm.executor, "local", llm.executor)
    executor.grammars = Grammars(None, vocab_size, eos, tokenizer_info=info, num_threads=args.fill_threads)
    return llm, lambda ids: b"".join(vocab[i] for i in ids if i not in eos).decode("utf-8", "replace")


def _prompts(llm: Any, rows: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    top = min(llm.model_config.vocab_size, 1000)
    return [[rng.randrange(3, top) for _ in range(length)] for _ in range(rows)]


def _check_correctness(llm: Any, decode: Any, prompts: list[list[int]]) -> int:
    """Run up to 16 small-schema rows to completion; every one must stop, parse and satisfy SMALL_SCHEMA; returns
    how many did."""
    from fnvllm.state import SamplingParams, StructuredOutput

    spec = StructuredOutput.json_schema(SMALL_SCHEMA)
    rows = prompts[:16]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=spec) for i in range(len(rows))]
    outs = llm.generate(rows, params, use_tqdm=False)
    valid = 0
    for out in outs:
        if out.finish_reason != "stop":
            continue
        value = json.loads(decode(list(out.token_ids)))
        assert set(value) == {"n", "unit", "ok"} and 0 <= value["n"] <= 999 and value["unit"] in ("c", "f", "k")
        assert isinstance(value["ok"], bool)
        valid += 1
    if valid < len(rows):
        raise SystemExit(f"correctness: only {valid} of {len(rows)} constrained rows finished (max_tokens 200)")
    return valid


def _timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, int]:
    """(seconds, tokens generated) of one run."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def _interleaved(llm: Any, prompts: list[list[int]], batches: list[list[Any]], repeats: int) -> list[tuple[float, int]]:
    """Per batch, (best seconds, tokens) over ``repeats`` rounds that run every batch in turn (drift in the
    machine's speed hits all batches alike)."""
    best = [(float("inf"), 0)] * len(batches)
    for _ in range(repeats):
        for k, params in enumerate(batches):
            seconds, tokens = _timed(llm, prompts, params)
            best[k] = min(best[k], (seconds, tokens))
    return best


def main() -> int:
    """Build, check, time; print a table last."""
    args = _args()
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("bench_structured: xgrammar is not installed (pip install xgrammar, or carry its wheel); skipped.")
        return 0
    from fnvllm.state import SamplingParams, StructuredOutput

    with _checkpoint(args) as folder:
        llm, decode = _build(args, folder)
        prompts = _prompts(llm, args.rows, args.prompt_len)
        valid = _check_correctness(llm, decode, prompts)
        long_spec = StructuredOutput.json_schema(LONG_SCHEMA)
        plain = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)] * args.rows
        num_constrained = round(args.rows * args.fraction)
        mixed = list(plain)
        for i in range(num_constrained):  # spread over the batch
            mixed[i * args.rows // max(num_constrained, 1)] = SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, structured=long_spec
            )
        _timed(llm, prompts[:16], mixed[:16])  # warm-up: compile, graphs
        results = {"": _interleaved(llm, prompts, [plain, mixed], args.repeats)}
        overlap = llm.loop.overlap
        executor = getattr(llm.executor, "local", llm.executor)
        if overlap and args.variants:  # the other place a deferred step may sample (ModelExecutor docstring)
            executor.sample_deferred_at = "collect"
            results[", sampled at collect"] = _interleaved(llm, prompts, [plain, mixed], args.repeats)
            executor.sample_deferred_at = "launch"
            default = executor.grammars
            for workers in (4, 8):  # grammar workers that each accept and fill a chunk of the rows
                executor.grammars = _with_workers(default, workers)
                results[f", {workers} grammar workers"] = _interleaved(llm, prompts, [plain, mixed], args.repeats)
            executor.grammars = default
        if args.plain and overlap:
            from fnvllm.engine.loop import EngineLoop

            llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
            results[", plain steps"] = _interleaved(llm, prompts, [plain, mixed], args.repeats)
        llm.close()
    if args.host_steps:
        _host_table(num_constrained, args.host_steps)
    print(f"\ndevice {args.device}, overlap {overlap}, {args.rows} rows x {args.max_tokens} tokens, correctness "
          f"{valid}/{min(16, len(prompts))} constrained outputs valid")  # fmt: skip
    print(f"{'batch':<48}{'seconds':>10}{'tokens':>10}{'tok/s':>12}{'ms/step':>10}")
    for suffix, ((t_plain, n_plain), (t_mixed, n_mixed)) in results.items():
        label = f"{num_constrained} constrained ({args.fraction:.0%}){suffix}"
        for name, seconds, tokens in ((f"unconstrained{suffix}", t_plain, n_plain), (label, t_mixed, n_mixed)):
            step_ms = 1e3 * seconds / args.max_tokens
            print(f"{name:<48}{seconds:>10.3f}{tokens:>10}{tokens / seconds:>12.0f}{step_ms:>10.2f}")
        print(f"{'mixed / unconstrained time' + suffix:<48}{t_mixed / t_plain:>10.3f}")
    return 0


def _with_workers(grammars: Any, workers: int) -> Any:
    """A Grammars like ``grammars`` with ``workers`` grammar workers sharing its xgrammar threads."""
    from fnvllm.executor.structured import Grammars

    return Grammars(
        grammars.tokenizer,
        grammars.vocab_size,
        grammars.stop_ids,
        grammars.tokenizer_info,
        grammars.num_threads,
        workers,
    )


def _host_table(rows: int, steps: int) -> None:
    """benchmarks/structured_host.py's table for ``rows`` constrained rows (1, 8, all but one xgrammar threads on
    one worker; 4, 8, 15 workers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import structured_host

    sys.argv = [sys.argv[0], "--rows", str(max(rows, 1)), "--steps", str(steps), "--threads", "1,8,auto,4x4,8x2,15x1"]
    structured_host.main()


if __name__ == "__main__":
    sys.exit(main())
