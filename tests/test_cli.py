"""The ``fnvllm`` command line, run as a real subprocess against the embedded demo model (the quick user-error
cases one after another in one subprocess: tests/script_batch.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from script_batch import run_batch

from fnvllm import BeamSearchParams
from fnvllm.cli import build_parser
from fnvllm.cli._common import engine_options, sampling_params
from fnvllm.config import EngineConfig
from fnvllm.demo import model_path
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

FAST = ["--max-tokens", "6", "--num-blocks", "64"]
TINY_BENCH = ["bench", "--model-shape", "tiny"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def fnvllm(*args: str, stdin: str | None = None, script: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``fnvllm ARGS`` (the console script, or ``python -m fnvllm.cli``) and capture its output."""
    command = [console_script()] if script else [sys.executable, "-m", "fnvllm.cli"]
    return subprocess.run(
        [*command, *args], input=stdin, capture_output=True, text=True, timeout=180, env=ENV, check=False
    )


def console_script() -> str:
    """The ``fnvllm`` script installed beside this interpreter (the venv's bin folder)."""
    return str(Path(sys.executable).parent / "fnvllm")


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``result`` after checking it succeeded (its stderr shown otherwise)."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def jsonl(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines text."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def error_lines(stderr: str) -> list[str]:
    """stderr's lines, less the loader's progress bar."""
    return [line for line in stderr.splitlines() if line.strip() and "shard" not in line]


def test_console_script_is_installed() -> None:
    """The venv holds an executable ``fnvllm`` script (the package's console entry point)."""
    script = Path(console_script())
    assert script.is_file() and os.access(script, os.X_OK)
    assert shutil.which("fnvllm", path=str(script.parent)) == str(script)


PROMPTS = ["def fib(", "import "]


PROMPTS_FILE = "{prompts file}"  # stands for the file of prompts that the ``generated`` fixture writes
# the generate/demo runs of the tests below: key -> (arguments, stdin); "plain" runs the console script
GENERATE_RUNS: dict[str, tuple[list[str], str | None]] = {
    "plain": (["generate", *PROMPTS, *FAST], None),
    "folder json": (
        ["generate", str(model_path()), "class A:", "--json", "--logprobs", "2", "--prompt-logprobs", "1", *FAST],
        None,
    ),
    "text logprobs": (["generate", "class A:", "--logprobs", "1", "--prompt-logprobs", "1", *FAST], None),
    "sources": (
        ["generate", "while ", "-", "--prompts-file", PROMPTS_FILE, "--json", *FAST],
        json.dumps({"prompt": "x = ["}) + "\n" + json.dumps({"prompt": "y = (\n"}) + "\n",
    ),
    "stream": (["generate", *PROMPTS, "--stream", *FAST], None),
    "stream json": (["generate", *PROMPTS, "--stream", "--json", *FAST], None),
    "chat json": (["generate", "--chat", "--system", "be brief", "reverse a list", "--json", *FAST], None),
    "chat stream": (["generate", "--chat", "reverse a list", "--stream", *FAST], None),
    "demo": (["demo", *FAST], None),
    "beam": (["generate", *PROMPTS, "--beam-width", "3", "--length-penalty", "0.5", *FAST], None),
    "beam json": (["generate", *PROMPTS, "--beam-width", "3", "--length-penalty", "0.5", "--json", *FAST], None),
}
# which runs each test reads
GENERATE_TESTS = {
    "test_generate_prompt_arguments_with_the_embedded_model": ("plain",),
    "test_generate_model_folder_argument_json": ("folder json",),
    "test_text_output_shows_both_logprobs": ("text logprobs",),
    "test_prompts_from_arguments_stdin_and_file": ("sources",),
    "test_stream_prints_what_generate_prints": ("plain", "stream", "stream json"),
    "test_chat_applies_the_chat_template": ("chat json", "chat stream"),
    "test_demo_says_it_uses_the_embedded_model": ("demo",),
    "test_beam_width_prints_each_prompts_beams_best_first": ("beam", "beam json"),
}


@pytest.fixture(scope="module")
def generated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """The GENERATE_RUNS the selected tests read, each its own ``fnvllm`` process, two at a time (CI has two cores;
    each run is mostly one busy thread): key -> its CompletedProcess (not yet checked)."""
    selected = {getattr(item, "originalname", None) for item in request.session.items}
    keys = sorted({key for test, keys in GENERATE_TESTS.items() if test in selected for key in keys})
    file = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    file.write_text("def a(\n\nclass B:\n")

    def one(key: str) -> subprocess.CompletedProcess[str]:
        args, stdin = GENERATE_RUNS[key]
        return fnvllm(*[str(file) if a == PROMPTS_FILE else a for a in args], stdin=stdin, script=key == "plain")

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


@pytest.fixture(scope="module")
def plain(generated: dict[str, subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    """``fnvllm generate`` (the console script) on PROMPTS, greedy, as text."""
    return ok(generated["plain"])


def test_generate_prompt_arguments_with_the_embedded_model(plain: subprocess.CompletedProcess[str]) -> None:
    """``fnvllm generate PROMPT PROMPT`` uses the demo model, prints each prompt with its continuation, and ends
    with a one-line summary on stderr."""
    assert plain.stdout.count("===== request") == 2
    assert all(prompt in plain.stdout for prompt in PROMPTS)
    summary = error_lines(plain.stderr)[-1]
    assert "2 requests" in summary and "tok/s" in summary and "prefix-cache" in summary and "preemptions" in summary


def test_generate_model_folder_argument_json(generated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """A first argument that is a folder is the model; ``--json`` prints one parseable object per request."""
    result = ok(generated["folder json"])
    [record] = jsonl(result.stdout)
    assert record["prompt"] == "class A:" and record["index"] == 0
    assert len(record["token_ids"]) == len(record["logprobs"]) <= 6
    assert all(len(entry["top"]) == 2 for entry in record["logprobs"])
    assert record["finish_reason"] in ("stop", "length") and record["ttft_s"] >= 0
    scored = record["prompt_logprobs"]
    assert len(scored) == record["num_prompt_tokens"] and scored[0] is None
    assert all(len(e["top"]) == 1 and e["logprob"] <= 0 for e in scored[1:])


def test_text_output_shows_both_logprobs(generated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """In text, ``--prompt-logprobs`` prints a line per prompt token after the first, then ``--logprobs`` one per
    generated token."""
    lines = ok(generated["text logprobs"]).stdout.splitlines()
    start, middle = lines.index("  prompt logprobs (from its second token):"), lines.index("  logprobs:")
    assert middle - start - 1 > 0 and len(lines) - middle - 1 == 6  # FAST generates 6 tokens


def test_prompts_from_arguments_stdin_and_file(generated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Prompts come from the arguments, then stdin ('-', JSON Lines here), then ``--prompts-file`` (one per line,
    blank lines skipped), in that order; --json on stdout stays clean (the summary goes to stderr)."""
    result = ok(generated["sources"])  # the file holds "def a(", a blank line and "class B:"
    records = jsonl(result.stdout)
    assert [r["prompt"] for r in records] == ["while ", "x = [", "y = (\n", "def a(", "class B:"]
    assert [r["index"] for r in records] == list(range(5))


def test_stream_prints_what_generate_prints(
    plain: subprocess.CompletedProcess[str], generated: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    """Greedy ``--stream`` prints the same text as plain generate, in prompt order; JSON deltas add up to it."""
    streamed = ok(generated["stream"]).stdout
    deltas = jsonl(ok(generated["stream json"]).stdout)
    strip = [line for line in plain.stdout.splitlines() if not line.startswith("=====")]
    assert [line for line in streamed.splitlines() if not line.startswith("=====")] == strip
    texts = ["".join(d["text"] for d in deltas if d["index"] == i) for i in range(len(PROMPTS))]
    assert "\n".join(p + t for p, t in zip(PROMPTS, texts, strict=True)) == "\n".join(strip)
    assert sum(d["finish_reason"] is not None for d in deltas) == len(PROMPTS)


def test_chat_applies_the_chat_template(generated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``--chat`` wraps the prompt as a user message through the tokenizer's template (a Python comment here)."""
    result = ok(generated["chat json"])
    [record] = jsonl(result.stdout)
    assert record["prompt"] == "# be brief\n# reverse a list\n"
    streamed = ok(generated["chat stream"]).stdout
    assert "reverse a list" not in streamed  # the reply only


def test_demo_says_it_uses_the_embedded_model(generated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``fnvllm demo`` names the embedded model and prints Python prompts with their continuations."""
    result = ok(generated["demo"])
    assert "embedded demo model" in result.stdout and "def fib(n):" in result.stdout
    assert "requests" in error_lines(result.stderr)[-2]


def test_beam_width_prints_each_prompts_beams_best_first(
    generated: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """``--beam-width 3 --length-penalty 0.5`` prints ``LLM.beam_search``'s beams of each prompt, best first: as
    text, each under a header with its length, finish reason and cum_logprob, then the prompt and the beam's text;
    with ``--json``, one object per prompt whose "beams" hold the generated ids."""
    llm = LLM(model_path(), num_blocks=64)  # the CLI's engine options (FAST)
    want = llm.beam_search(PROMPTS, BeamSearchParams(3, 6, length_penalty=0.5), use_tqdm=False)
    records = jsonl(ok(generated["beam json"]).stdout)
    assert [r["prompt"] for r in records] == PROMPTS and [r["index"] for r in records] == [0, 1]
    for record, out in zip(records, want, strict=True):
        assert [b["token_ids"] for b in record["beams"]] == [list(s.output_token_ids) for s in out.sequences]
        assert [b["cum_logprob"] for b in record["beams"]] == pytest.approx([s.cum_logprob for s in out.sequences])
    text = ok(generated["beam"]).stdout
    headers = re.findall(
        r"^===== request (\d+) \(beam (\d+), (\d+) tokens, (\w+), cum_logprob (\S+)\) =====$", text, re.M
    )
    sequences = [(i, j, s) for i, out in enumerate(want) for j, s in enumerate(out.sequences)]
    assert len(headers) == len(sequences) == 6
    for (index, rank, length, reason, cum), (i, j, seq) in zip(headers, sequences, strict=True):
        assert (int(index), int(rank), int(length), reason) == (i, j, len(seq.output_token_ids), seq.finish_reason)
        assert float(cum) == pytest.approx(seq.cum_logprob, abs=1e-3)
    bodies = re.split(r"^===== request .* =====\n", text, flags=re.M)[1:]
    answers = [llm.tokenizer.decode(list(s.answer_token_ids), skip_special_tokens=True) for _, _, s in sequences]
    assert bodies == [PROMPTS[i] + answer + "\n" for (i, _, _), answer in zip(sequences, answers, strict=True)]


TOO_LONG = "x = 1\n" * 400


BAD_INPUTS: list[tuple[list[str], str | None, int, str]] = [
    (["generate", "/no/such/model", "def f("], None, 1, "does not exist"),
    (["generate", "--model", "/no/such/model", "def f("], None, 1, "does not exist"),
    (["generate", "--prompts-file", "/no/such/prompts.txt"], None, 1, "cannot read prompts"),
    (["generate", "--prompts-file", "-"], "{not json\n", 1, "stdin:1: not valid JSON"),
    (["generate", "--max-tokens", "lots", "def f("], None, 2, "invalid int value"),
    (["generate", "--temperature", "-1", "def f("], None, 2, "temperature"),
    (["generate", "--block-size", "0", "def f("], None, 2, "block_size"),
    (["generate", "--dtype", "float64", "def f("], None, 2, "float64"),
    (["generate", "--device", "cpu", "--attention-backend", "flash", "def f("], None, 2, "flash"),
    (["generate", "--stop-token-ids", "1,x", "def f("], None, 2, "comma-separated integers"),
    (["generate", "--stream", "--logprobs", "1", "def f("], None, 2, "drop --stream"),
    (["generate", "--beam-width", "2", "--n", "2", "def f("], None, 2, "--beam-width and --n cannot be combined"),
    (["generate", "--beam-width", "2", "--stream", "def f("], None, 2, "--beam-width and --stream"),
    (["generate", "--beam-width", "11", "def f("], None, 2, "--beam-width must be an int in [1, 10]"),
    (["generate", "--length-penalty", "0.5", "def f("], None, 2, "--length-penalty needs --beam-width"),
    (["generate", "--chat", "--prompts-file", "-"], '{"messages": []}\n', 1, "stdin:1"),
    (["generate", "-"], '{"messages": [{"role": "user", "content": "hi"}]}\n', 2, "needs --chat"),
    (["generate", "--num-blocks", "64", TOO_LONG], None, 1, "max_model_len"),
    (["generate"], None, 2, "no prompt given"),
    (["bench", "--num-requests", "0"], None, 1, "num_requests must be >= 1"),
]


# the other quick runs that end in a user error: key -> (module, arguments); FILE is a file the fixture writes
QUICK_ERRORS: dict[str, tuple[str, list[str]]] = {
    "debug": ("fnvllm.cli", ["--debug", "generate", "--temperature", "-1", "def f("]),
    "model is a file": ("fnvllm.cli", ["generate", "--model", "FILE", "hi"]),
    "bad latency list": ("fnvllm.cli", ["bench", "--latency", "1,x"]),
    "bad bench top-p": ("fnvllm", ["bench", "--num-requests", "2", "--top-p", "7"]),
}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``python -m MODULE ARGS`` of every BAD_INPUTS case (keyed by ``json.dumps([args, stdin])``) and of every
    QUICK_ERRORS one, run one after another in one interpreter (tests/script_batch.py: each as ``__main__`` with
    its own argv and stdin), so torch is imported once, not nineteen times."""
    folder = tmp_path_factory.mktemp("quick-cli")
    file = folder / "model.safetensors"
    file.write_bytes(b"x")
    jobs = [
        {"key": json.dumps([args, stdin]), "run": "module", "target": "fnvllm.cli", "args": args, "stdin": stdin}
        for args, stdin, _, _ in BAD_INPUTS
    ]
    for key, (module, args) in QUICK_ERRORS.items():
        args = [str(file) if arg == "FILE" else arg for arg in args]
        jobs.append({"key": key, "run": "module", "target": module, "args": args})
    return run_batch(jobs, folder, ENV, timeout=300)


@pytest.mark.parametrize(("args", "stdin", "code", "needle"), BAD_INPUTS)
def test_bad_input_is_one_line_and_a_nonzero_exit(
    args: list[str], stdin: str | None, code: int, needle: str, quick_results: dict[str, dict[str, Any]]
) -> None:
    """Each user error prints one line on stderr naming the problem, exits non-zero, and shows no traceback."""
    result = quick_results[json.dumps([args, stdin])]
    lines = error_lines(result["stderr"])
    assert result["returncode"] == code, result["stderr"]
    assert len(lines) == 1 and needle in lines[0] and "error" in lines[0], result["stderr"]
    assert "Traceback" not in result["stderr"]


def test_debug_shows_the_traceback(quick_results: dict[str, dict[str, Any]]) -> None:
    """``--debug`` shows the traceback of a user error instead of the one-line message."""
    result = quick_results["debug"]
    assert result["returncode"] != 0 and "Traceback" in result["stderr"]


def test_every_sampling_and_engine_field_has_a_flag() -> None:
    """The flags are derived from SamplingParams and EngineConfig, so every field is settable from the CLI."""
    flags = """generate p --temperature 0.7 --top-p 0.9 --top-k 5 --min-p 0.05 --max-tokens 7 --ignore-eos
        --stop a --stop b --stop-token-ids 3,4 --include-stop-str-in-output --seed 1 --logprobs 2
        --repetition-penalty 1.1 --presence-penalty 0.5 --frequency-penalty -0.5 --block-size 32
        --logit-bias 12:5,7:-100 --prompt-logprobs 1 --min-tokens 2 --n 3 --no-skip-special-tokens
        --truncate-prompt-tokens 5 --allowed-token-ids 3,4,12 --bad-words Paris --bad-words x
        --bad-words-token-ids 5 --bad-words-token-ids 6,7
        --no-prefix-caching --engine-seed 9 --max-model-len 256 --device cpu"""
    args = build_parser().parse_args(flags.split())
    expected = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_tokens=7, ignore_eos=True, stop=("a", "b"),
        stop_token_ids=(3, 4), include_stop_str_in_output=True, seed=1, logprobs=2, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={12: 5, 7: -100}, prompt_logprobs=1, min_tokens=2,
        n=3, skip_special_tokens=False, truncate_prompt_tokens=5, allowed_token_ids=(3, 4, 12),
        bad_words=("Paris", "x"), bad_words_token_ids=((5,), (6, 7)),
    )  # fmt: skip
    assert sampling_params(args) == expected
    assert {"sp_" + f.name for f in SamplingParams.__attrs_attrs__ if f.init} <= set(vars(args))
    as_json = build_parser().parse_args(["generate", "p", "--logit-bias", '{"12": 5, "7": -100}'])
    assert sampling_params(as_json).logit_bias == expected.logit_bias
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "p", "--logit-bias", "12=5"])
    options = engine_options(args)
    assert set(options) == {f.name for f in EngineConfig.__attrs_attrs__}
    assert options["block_size"] == 32 and options["seed"] == 9 and options["enable_prefix_caching"] is False


def test_generate_model_that_is_a_file_says_so(quick_results: dict[str, dict[str, Any]]) -> None:
    """``fnvllm generate --model FILE`` says the path is a file, not that the folder "does not exist"."""
    done = quick_results["model is a file"]
    assert done["returncode"] == 1
    assert "is a file, not a folder" in done["stderr"] and "does not exist" not in done["stderr"]


# the ``fnvllm bench`` runs of the tests below: key -> (module, arguments, whether TMPDIR is the run's own folder)
BENCH_RUNS: dict[str, tuple[str, list[str], bool]] = {
    "requests 1": ("fnvllm.cli", [*TINY_BENCH, "--num-requests", "1", "--max-output-len", "100", "--json", "--profile"],
                   True),
    "requests 3": ("fnvllm.cli", [*TINY_BENCH, "--num-requests", "3", "--max-output-len", "100", "--json"], True),
    "latency": ("fnvllm.cli", [*TINY_BENCH, "--latency", "1,3", "--max-output-len", "6", "--profile", "--json"], True),
    "sampling": ("fnvllm", ["bench", "--num-requests", "2", "--preset", "qwen3", "--repetition-penalty", "1.05",
                            "--max-output-len", "100", "--json"], False),
}  # fmt: skip
# which runs each test reads
BENCH_TESTS = {
    "test_bench_on_the_cpu_runs_any_request_count_and_cleans_up": ("requests 1", "requests 3"),
    "test_bench_latency_mode_reports_each_batch": ("latency",),
    "test_bench_takes_the_sampling_settings_users_send": ("sampling",),
}


@pytest.fixture(scope="module")
def bench_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """The BENCH_RUNS the selected tests read, each ``python -m MODULE ARGS`` in its own process (with its own
    TMPDIR where asked), two at a time (CI has two cores; each run is mostly one busy thread): key -> (its
    CompletedProcess, its TMPDIR folder)."""
    selected = {getattr(item, "originalname", None) for item in request.session.items}
    keys = [key for test, keys in BENCH_TESTS.items() if test in selected for key in keys]

    # the folders before the threads, which would race to create the worker's base folder (test_benchmarks_smoke)
    folders = {key: tmp_path_factory.mktemp("bench") for key in keys}

    def one(key: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        module, args, own_tmp = BENCH_RUNS[key]
        folder = folders[key]
        env = {**ENV, "TMPDIR": str(folder)} if own_tmp else {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", module, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False), folder

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


@pytest.mark.parametrize("num_requests", ["1", "3"])
def test_bench_on_the_cpu_runs_any_request_count_and_cleans_up(
    num_requests: str, bench_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]]
) -> None:
    """``fnvllm bench`` on the tiny shape works with fewer requests than its 4-request warm-up, prints no GPU-only
    fields on a CPU (with --profile too), and deletes the random checkpoint it wrote."""
    result, tmp_path = bench_runs[f"requests {num_requests}"]
    record = json.loads(ok(result).stdout)
    assert record["requests"] == int(num_requests) and record["device"] == "cpu" and record["output_tokens"] >= 100
    assert not {"floor_tok_per_s", "fraction_of_floor", "ceilings"} & set(record)
    assert "gpu" not in json.dumps(record.get("timeline"))  # a CPU step's time is named as such, not GPU time
    assert "writing a random tiny checkpoint" in result.stderr  # stderr is a pipe: plain progress lines
    assert not list(tmp_path.glob("fnvllm-bench-*"))


def test_bench_latency_mode_reports_each_batch(
    bench_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]], quick_results: dict[str, dict[str, Any]]
) -> None:
    """``fnvllm bench --latency 1,3`` runs each batch warm and reports ms per decode step, TPOT and TTFT percentiles
    per request count (each request makes exactly --max-output-len tokens); a bad list is a usage error."""
    result, _ = bench_runs["latency"]
    record = json.loads(ok(result).stdout)
    rows = record["latency"]
    assert "ceilings" not in record  # the floor's rates: a GPU's
    assert [row["requests"] for row in rows] == [1, 3]
    for row in rows:
        assert row["ms_per_step"] > 0 and row["tpot_p50_ms"] > 0 and row["tpot_p99_ms"] >= row["tpot_p50_ms"]
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
        assert row["decode_timeline"]["steps"] >= 4  # 6 tokens: a prefill step, then decode steps
        assert not {"floor_ms_per_step", "fraction_of_floor"} & set(row)  # a GPU roofline: not on a CPU
    bad = quick_results["bad latency list"]
    assert bad["returncode"] == 2 and "comma-separated request counts" in bad["stderr"]


def test_bench_defaults_depend_on_the_shape() -> None:
    """The tiny shape gets the CPU-sized workload, the real shapes the nano-vllm one; explicit flags win."""
    from fnvllm.cli.bench import resolve_workload

    tiny = build_parser().parse_args(["bench", "--model-shape", "tiny", "--max-output-len", "200"])
    resolve_workload(tiny)
    assert (tiny.num_requests, tiny.max_input_len, tiny.max_output_len, tiny.ec_block_size) == (32, 256, 200, 16)
    real = build_parser().parse_args(["bench", "--model-shape", "qwen3-8b"])
    resolve_workload(real)
    assert (real.num_requests, real.max_input_len, real.max_output_len, real.ec_block_size) == (256, 1024, 1024, 256)


def test_bench_progress_line_reports_tokens_share_and_rate() -> None:
    """The plain progress line (printed when stderr is not a terminal) says time, tokens of the total and tok/s."""
    from fnvllm.bench import Progress

    line = Progress(llm=None, total_tokens=4000, every_s=5.0).line(10.0, 1000)
    assert line == "bench: 10 s, 1,000 of 4,000 output tokens (25 %), 100 tok/s"


def test_bench_takes_the_sampling_settings_users_send(
    bench_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]], quick_results: dict[str, dict[str, Any]]
) -> None:
    """``fnvllm bench --preset qwen3 --repetition-penalty 1.05`` samples every request with top-p 0.95 / top-k 20
    and the penalty (reported in the result); an out-of-range setting is one line naming the field, exit 1."""
    done, _ = bench_runs["sampling"]
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sampling"] == {"top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert result["output_tokens"] > 0
    bad = quick_results["bad bench top-p"]
    assert bad["returncode"] != 0 and "top_p" in bad["stderr"] and "Traceback" not in bad["stderr"]


def test_field_docs_keep_a_continuation_that_reads_like_a_field() -> None:
    """A continuation line such as "needed: ..." belongs to the field above it (``--load-format``'s help was cut
    there), and a field after it starts afresh."""
    from fnvllm.cli._common import field_docs

    class Documented:
        """Example.

        first: starts here and
            needed: goes on here.
        second: its own.
        """

    assert field_docs(Documented) == {"first": "starts here and needed: goes on here.", "second": "its own."}
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()  # type: ignore[union-attr]
    assert "no weight files needed" in " ".join(help_text.split())


def test_a_model_folder_without_a_tokenizer_asks_for_the_tokenizer_flag(tmp_path: Path) -> None:
    """A checkpoint without tokenizer files is a one-line error naming ``--tokenizer``; with ``--tokenizer`` (the
    demo model's, same vocabulary size) it generates."""
    from fnvllm.model.config import ModelConfig
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    vocab = ModelConfig.from_pretrained(model_path()).vocab_size
    folder = write_tiny_checkpoint(tmp_path / "bare", "qwen3", vocab_size=vocab)
    refused = fnvllm("generate", str(folder), "def f(", *FAST)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"{folder} holds no tokenizer files; pass --tokenizer FOLDER" in refused.stderr
    given = ok(fnvllm("generate", str(folder), "def f(", "--tokenizer", str(model_path()), *FAST))
    assert given.stdout.startswith("def f(")
