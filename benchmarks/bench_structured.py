"""Cost of grammar-constrained rows in a batch: a mix (default 25 % JSON-schema rows) against the same batch all
unconstrained, in one run, plus a correctness check (constrained outputs parse and satisfy their schema).

python benchmarks/bench_structured.py                       # H200: random Qwen3-0.6B, 256 rows, 25 % constrained
python benchmarks/bench_structured.py --model PATH          # a checkpoint folder (its tokenizer, if it has one)
python benchmarks/bench_structured.py --device cpu --model-shape demo --rows 32 --fraction 0.5 --max-tokens 32

Without a tokenizer (the random checkpoints) the grammars get a vocabulary of the model's size, ``--vocabulary``:

- ``bpe`` (default): a real byte-level BPE vocabulary learned from this Python's standard library (the demo
  model's recipe, ``fnvllm.demo.data``: ~41k tokens of code and English), then multilingual tokens (CJK, Hangul,
  Cyrillic, Arabic, kana, Devanagari, accented Latin: 1-4 characters, some with a leading space) up to the size,
  as Qwen's 151,936 ids are mostly multilingual. What a JSON mask costs depends on how many tokens hold a quote
  (xgrammar must check those against the rest of the grammar at run time inside a string): 987 here (2.4 % of the
  BPE part), against ~10,100 (6.6 % of all) in the synthetic one.
- ``synthetic``: byte tokens plus random JSON-ish strings of 2-8 bytes; a worst case (one token in 15 holds a
  quote, followed by random characters), ~20x the bpe vocabulary's fill time per row inside a string.

The other vocabulary is timed too (``--other-vocabulary``, on by default), so both ratios are printed.

Every row generates exactly --max-tokens tokens in both runs: unconstrained rows ignore EOS, constrained rows
follow a schema that cannot end sooner (an array of at least 10,000 objects), so the two runs do the same work
apart from the masks. After the timed runs, one more run of each batch with the step timeline on gives the
device / host / idle ms per step, and the grammar stats give where the host's grammar time went per step (the
fill and the accept on the grammar worker, and the engine loop's wait for the fill: what the fill adds to the
critical path). Needs xgrammar (``pip install xgrammar``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
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
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"other configurations to time, comma-separated, of {', '.join(VARIANTS)}")  # fmt: skip
    p.add_argument("--host-steps", type=int, default=32, help="steps of the host-cost table (0: none)")
    p.add_argument("--host-vocab", type=int, default=151936,
                   help="vocabulary size of the host-cost table's grammars (Qwen3's by default)")  # fmt: skip
    p.add_argument(
        "--fill-threads", type=int, default=None, help="xgrammar's fill threads (default: cores - 1, at most 8)"
    )
    p.add_argument("--process", action=argparse.BooleanOptionalAction, default=None,
                   help="the default's matchers in a grammar process (default: where CUDA is)")  # fmt: skip
    p.add_argument("--vocabulary", choices=VOCABS, default="bpe", help="of a checkpoint without a tokenizer")
    p.add_argument("--other-vocabulary", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the mix with the other --vocabulary (default on)")  # fmt: skip
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


# Unicode blocks of the multilingual tokens that fill a bpe vocabulary up to the model's size.
SCRIPTS = ((0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x0400, 0x04FF), (0x0600, 0x06FF), (0x3040, 0x30FF),
           (0x0900, 0x097F), (0x00C0, 0x024F))  # fmt: skip


@functools.cache
def _bpe_vocab(size: int) -> list[bytes]:
    """A byte-level BPE vocabulary learned from the standard library (at most ``size`` tokens; ~41k reach the
    tokenizers trainer's minimum pair count of 2), then distinct multilingual tokens up to ``size`` (module
    docstring). Seconds to build; deterministic."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from fnvllm.demo.data import corpus_files, read_texts

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(read_texts(corpus_files()), trainer=trainer)
    to_byte = _byte_decoder()
    learned = sorted(backend.get_vocab().items(), key=lambda item: item[1])
    vocab = [bytes(to_byte[ch] for ch in text) for text, _ in learned]
    seen, rng = set(vocab), random.Random(0)
    while len(vocab) < size:
        low, high = rng.choice(SCRIPTS)
        text = "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 4)))
        token = ((" " if rng.random() < 0.3 else "") + text).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE token -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


VOCABS = {"bpe": _bpe_vocab, "synthetic": _synthetic_vocab}
ALL_CORES = os.sched_getaffinity(0)  # before any grammar process split them (the thread variants run on them all)
PROCESS: list[bool | None] = [None]  # --process, for every Grammars attached here
QUOTED: dict[str, int] = {}  # per vocabulary attached: how many of its tokens hold a quote (module docstring)


def _build(args: argparse.Namespace, folder: Path) -> tuple[Any, Any]:
    """(the LLM, a decode function of token ids) with grammars attached (over ``args.vocabulary`` when the checkpoint
    has no tokenizer)."""
    from fnvllm.engine.text import has_tokenizer_files
    from fnvllm.llm import LLM

    has_tokenizer = has_tokenizer_files(folder)
    options: dict[str, Any] = {"device": args.device, "max_num_seqs": args.rows, "enable_prefix_caching": False}
    if args.device == "cpu":
        options |= {"dtype": "float32", "attention_backend": "torch"}
    llm = LLM(folder, load_tokenizer=has_tokenizer, **options)
    if has_tokenizer:
        grammars = _executor(llm).grammars
        if grammars is not None and args.fill_threads:
            grammars.num_threads = args.fill_threads
        if grammars is not None:
            grammars.process = args.process
        return llm, lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)
    return llm, _attach_vocab(llm, args.vocabulary, args.fill_threads)


def _executor(llm: Any) -> Any:
    """The LLM's ModelExecutor (rank 0's under tensor parallelism)."""
    return getattr(llm.executor, "local", llm.executor)


def _attach_vocab(llm: Any, name: str, fill_threads: int | None) -> Any:
    """Give the executor Grammars over the ``name`` vocabulary of the model's size; returns a decode function."""
    import xgrammar as xgr

    from fnvllm.executor.structured import Grammars

    vocab_size = llm.model_config.vocab_size
    eos = sorted(llm.engine.config.eos_token_ids)
    vocab = VOCABS[name](vocab_size)
    QUOTED[name] = sum(b'"' in token for token in vocab)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos)
    _executor(llm).grammars = Grammars(
        None, vocab_size, eos, tokenizer_info=info, num_threads=fill_threads, process=PROCESS[0]
    )
    return lambda ids: b"".join(vocab[i] for i in ids if i not in eos).decode("utf-8", "replace")


def _prompts(llm: Any, rows: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    top = min(llm.model_config.vocab_size, 1000)
    return [[rng.randrange(3, top) for _ in range(length)] for _ in range(rows)]


def _preflight(llm: Any) -> bool:
    """When the default grammars use a grammar process: start it and send one mask through it to the device; if
    that fails, say why and fall back to this process's matchers (so the run still times the rest). Returns
    whether grammar processes work here."""
    from fnvllm.state import StructuredOutput

    grammars = _executor(llm).grammars
    if grammars is None or not grammars.uses_process:
        return True
    try:
        remote = grammars._process()
        live = remote.new(StructuredOutput.json_schema(SMALL_SCHEMA))
        device = _executor(llm).device
        host = grammars.masks([live], pinned=device.type == "cuda")
        if host is None:
            raise RuntimeError("no mask came back for a constrained row")
        mask = host.upload(device)
        allowed = int(mask.bitmask.ne(0).sum().item())
        remote.drop([live])
        pinned = bool(remote._maps and remote._maps[-1][2])
        print(f"grammar process: up (masks pinned: {pinned}, pin failed: {remote.pin_failed}, cores {remote.cores}); "
              f"first mask allows {allowed} words", flush=True)  # fmt: skip
        return True
    except Exception as error:  # any failure: report it, time the rest without the process
        import traceback

        traceback.print_exc()
        print(f"grammar process FAILED ({error!r}): the default falls back to this process's matchers", flush=True)
        grammars.close()
        grammars.process = False
        PROCESS[0] = False
        return False


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
    """Build, check, time; print each table as soon as it is known (a run cut short keeps them), the summary last."""
    args = _args()
    PROCESS[0] = args.process
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("bench_structured: xgrammar is not installed (pip install xgrammar, or carry its wheel); skipped.")
        return 0
    with _checkpoint(args) as folder:
        llm, decode = _build(args, folder)
        if not _preflight(llm):
            args.variants = ",".join(v for v in args.variants.split(",") if v.startswith("thread"))
        prompts = _prompts(llm, args.rows, args.prompt_len)
        valid = _check_correctness(llm, decode, prompts)
        plain, mixed = _batches(args)
        _timed(llm, prompts[:16], mixed[:16])  # warm-up: compile, graphs
        num_constrained = sum(p.structured is not None for p in mixed)
        print(f"\ndevice {args.device}, overlap {llm.loop.overlap}, {args.rows} rows x {args.max_tokens} tokens, "
              f"{num_constrained} constrained, correctness {valid}/{min(16, len(prompts))} constrained outputs valid, "
              f"grammar process {_executor(llm).grammars.uses_process}", flush=True)  # fmt: skip
        results, diagnosis = _variants(args, llm, folder, prompts, plain, mixed, num_constrained)
        llm.close()
    if args.host_steps:
        os.sched_setaffinity(0, ALL_CORES)  # the table's own fills (and "auto" threads) as on an unsplit machine
        _host_table(num_constrained, args.host_steps, args.host_vocab)
    for name, count in QUOTED.items():
        print(f"vocabulary {name}: {count} of its tokens hold a quote")
    _print_results(results, args, num_constrained)
    _print_diagnosis(diagnosis)
    for suffix, ((t_plain, _), (t_mixed, _)) in results.items():  # last: a log cut to its tail keeps the target
        print(f"summary{suffix or ' (default)'}: mixed / unconstrained time {t_mixed / t_plain:.3f}")
    return 0


def _print_results(results: dict[str, list[tuple[float, int]]], args: argparse.Namespace, num_constrained: int) -> None:
    """The timed pairs: seconds, tokens, tok/s and ms per step of each batch, and the ratio."""
    print(f"\n{'batch':<64}{'seconds':>10}{'tokens':>10}{'tok/s':>12}{'ms/step':>10}")
    for suffix, ((t_plain, n_plain), (t_mixed, n_mixed)) in results.items():
        label = f"{num_constrained} constrained ({args.fraction:.0%}){suffix}"
        for name, seconds, tokens in ((f"unconstrained{suffix}", t_plain, n_plain), (label, t_mixed, n_mixed)):
            step_ms = 1e3 * seconds / args.max_tokens
            print(f"{name:<64}{seconds:>10.3f}{tokens:>10}{tokens / seconds:>12.0f}{step_ms:>10.2f}")
        print(f"{'mixed / unconstrained time' + suffix:<64}{t_mixed / t_plain:>10.3f}", flush=True)


def _batches(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """(all rows unconstrained, the mix): ``args.fraction`` of the rows under LONG_SCHEMA, spread over the batch."""
    from fnvllm.state import SamplingParams, StructuredOutput

    long_spec = StructuredOutput.json_schema(LONG_SCHEMA)
    plain = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)] * args.rows
    num_constrained = round(args.rows * args.fraction)
    mixed = list(plain)
    for i in range(num_constrained):
        mixed[i * args.rows // max(num_constrained, 1)] = SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, structured=long_spec
        )
    return plain, mixed


# Besides the default (a grammar process where CUDA is, sampled at launch): BACKEND-WHERE, BACKEND "thread" (this
# process's grammar thread), "process" or "processN" (N worker threads in the process), either with "tT" (T xgrammar
# threads in all, default the default's), WHERE "launch" or "collect". process-collect measured 2.01x (2026-12-02).
VARIANTS = ("thread-collect", "thread-launch", "process2-launch", "process1t4-launch")


def _variants(
    args: argparse.Namespace,
    llm: Any,
    folder: Path,
    prompts: list[list[int]],
    plain: list[Any],
    mixed: list[Any],
    num_constrained: int,
) -> tuple[dict[str, list[tuple[float, int]]], dict[str, dict[str, float]]]:
    """Per configuration (a label suffix), the timed (plain, mixed) pair; and the per-step diagnosis of the default
    configuration (and of the other vocabulary). The default's diagnosis is printed at once, then the pairs of the
    default and of each variant after every round (the configurations take turns, so drift hits all alike)."""
    from fnvllm.engine.text import has_tokenizer_files

    executor = _executor(llm)
    vocab_label = "" if has_tokenizer_files(folder) else f" [{args.vocabulary} vocab]"
    default = executor.grammars
    diagnosis = {vocab_label: _diagnose(llm, prompts, plain, mixed)}
    _print_diagnosis(diagnosis)
    configs = {vocab_label: (default, executor.sample_deferred_at)}
    overlap = llm.loop.overlap
    names = [name for name in args.variants.split(",") if name] if overlap else []
    for name in names:
        found = re.fullmatch(r"(thread|process)(\d*)(?:t(\d+))?-(launch|collect)", name)
        if found is None:
            raise SystemExit(f"--variants: {name!r} is not BACKEND-WHERE (e.g. thread-collect, process2t4-launch)")
        kind, workers, threads, sampled = found.groups()
        backend = name.removesuffix(f"-{sampled}")
        grammars = _with_workers(default, int(workers or 1), int(threads or 0) or None, process=kind == "process")
        configs[f"{vocab_label}, {backend}, sampled at {sampled}"] = (grammars, sampled)
    results = _rounds(llm, prompts, plain, mixed, configs, args, num_constrained)
    executor.grammars, executor.sample_deferred_at = default, configs[vocab_label][1]
    if args.other_vocabulary and vocab_label:
        other = next(name for name in VOCABS if name != args.vocabulary)
        _attach_vocab(llm, other, args.fill_threads)
        _timed(llm, prompts[:16], mixed[:16])  # compiles the schema for this vocabulary
        results[f" [{other} vocab]"] = _interleaved(llm, prompts, [plain, mixed], args.repeats)
        diagnosis[f" [{other} vocab]"] = _diagnose(llm, prompts, plain, mixed)
        executor.grammars = default
    if args.plain and overlap:
        from fnvllm.engine.loop import EngineLoop

        llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
        results[f"{vocab_label}, plain steps"] = _interleaved(llm, prompts, [plain, mixed], args.repeats)
    return results, diagnosis


def _rounds(
    llm: Any,
    prompts: list[list[int]],
    plain: list[Any],
    mixed: list[Any],
    configs: dict[str, tuple[Any, str]],
    args: argparse.Namespace,
    num_constrained: int,
) -> dict[str, list[tuple[float, int]]]:
    """Per configuration (grammars, where a deferred step samples), the best (plain, mixed) over ``args.repeats``
    rounds in which every configuration runs both batches in turn; the table is printed after each round."""
    executor = _executor(llm)
    best: dict[str, list[tuple[float, int]]] = {label: [(float("inf"), 0)] * 2 for label in configs}
    split = os.sched_getaffinity(0)  # this thread's cores: half of them once a grammar process split them
    for round_ in range(args.repeats):
        for label, (grammars, sampled) in configs.items():
            executor.grammars, executor.sample_deferred_at = grammars, sampled
            os.sched_setaffinity(0, split if grammars.uses_process else ALL_CORES)  # threads here get every core
            if round_ == 0 and grammars is not configs[next(iter(configs))][0]:
                _timed(llm, prompts[:16], mixed[:16])  # starts its process, compiles its schema
            for k, params in enumerate((plain, mixed)):
                best[label][k] = min(best[label][k], _timed(llm, prompts, params))
        os.sched_setaffinity(0, split)
        print(f"\nafter round {round_ + 1} of {args.repeats}:")
        _print_results(best, args, num_constrained)
    return best


def _diagnose(llm: Any, prompts: list[list[int]], plain: list[Any], mixed: list[Any]) -> dict[str, float]:
    """One more run of each batch with the step timeline on (in memory) and the grammar stats reset: ms per decode
    step of device time, host time and device idle gap (each batch), and the grammar work of the mix per step."""
    from fnvllm.executor.timeline import StepTimeline

    executor = _executor(llm)
    saved = executor.timeline
    out: dict[str, float] = {}
    for name, params in (("plain", plain), ("mixed", mixed)):
        executor.timeline = StepTimeline(None, executor._timeline_header(), executor.device)
        executor.grammars.reset_stats()
        seconds, _ = _timed(llm, prompts, params)
        decode = executor.timeline.summary().get("decode", {})
        out |= {f"{name} {k}": decode.get(f"mean_{k}_ms", float("nan")) for k in ("gpu", "cpu", "gap")}
        out[f"{name} ms/step"] = 1e3 * seconds / max(1, params[0].max_tokens)
    out["ms/step ratio"] = out["mixed ms/step"] / out["plain ms/step"]
    out["cpu ratio"] = out["mixed cpu"] / out["plain cpu"]  # the host's cycle: what bounds a host-bound step
    stats = executor.grammars.reset_stats()
    steps = max(1, stats.num_fills)
    out |= {"fill": 1e3 * stats.fill_s / steps, "accept": 1e3 * stats.accept_s / steps,
            "wait": 1e3 * stats.wait_s / steps, "rows/fill": stats.rows_filled / steps}  # fmt: skip
    executor.timeline = saved
    return out


def _print_diagnosis(diagnosis: dict[str, dict[str, float]]) -> None:
    """The per-step table of ``_diagnose`` (one row per configuration)."""
    if not diagnosis:
        return
    names = list(next(iter(diagnosis.values())))
    print("\nper decode step, ms (timeline: gpu = device time of a step, from its forward to its sampler, so a step")
    print("that samples late counts the device's wait for its masks; cpu = host time of a loop cycle; gap = device")
    print("idle before a step; fill / accept = in xgrammar's calls; wait = engine loop blocked on the fill)")
    print(f"{'configuration':<22}" + "".join(f"{name:>16}" for name in names))
    for label, row in diagnosis.items():
        print(f"{label.strip() or 'default':<22}" + "".join(f"{row[name]:>16.3f}" for name in names))
    print(flush=True)


def _with_workers(grammars: Any, workers: int, threads: int | None = None, process: bool | None = None) -> Any:
    """A Grammars like ``grammars`` with ``workers`` grammar workers sharing ``threads`` xgrammar threads (default:
    as many as ``grammars``), in a grammar process or this one (``process``; None: the default)."""
    from fnvllm.executor.structured import Grammars

    return Grammars(
        grammars.tokenizer,
        grammars.vocab_size,
        grammars.stop_ids,
        grammars.tokenizer_info,
        threads or grammars.num_threads,
        workers,
        process,
    )


def _host_table(rows: int, steps: int, vocab: int) -> None:
    """benchmarks/structured_host.py's table for ``rows`` constrained rows, both vocabularies of ``vocab`` tokens (1,
    8, the default xgrammar threads on one worker; 4 workers of 4 threads; the grammar process with the default
    threads)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import structured_host

    structured_host.VOCABS = VOCABS  # this module's, whose vocabularies are built already
    sys.argv = [sys.argv[0], "--rows", str(max(rows, 1)), "--steps", str(steps), "--vocab", str(vocab),
                "--threads", "1,8,auto,4x4,p1xauto"]  # fmt: skip
    structured_host.main()


if __name__ == "__main__":
    sys.exit(main())
