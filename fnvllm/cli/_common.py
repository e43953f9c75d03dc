"""Options, model loading and printing shared by the subcommands.

The sampling flags are derived from ``SamplingParams``'s fields and the engine flags from ``EngineConfig``'s
(names, types, defaults, choices, and the help text from each class's docstring), so a field added there becomes a
flag here without an edit. Two names change on the way: ``EngineConfig.seed`` is ``--engine-seed`` (``--seed`` is
the per-request sampling seed) and ``enable_prefix_caching`` is ``--no-prefix-caching``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.cli import CLIError
from fnvllm.config import EngineConfig
from fnvllm.state import InvalidConfigError, InvalidRequestError, SamplingParams, StructuredOutput

# The CLI's own defaults where they differ from SamplingParams': greedy and reproducible, a screenful of tokens.
CLI_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "max_tokens": 64}
_ENGINE_FLAG_NAMES = {"seed": "engine_seed"}
# Help for fields their class docstring mentions only in passing.
_EXTRA_DOCS = {"include_stop_str_in_output": "keep the stop string that ended generation at the end of the text."}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description from a class docstring written as ``name: text`` (or ``a / b: text``) lines,
    continuation lines indented deeper than their field's line."""
    docs: dict[str, str] = {}
    current: list[str] = []
    field_indent = 0
    for line in (cls.__doc__ or "").splitlines():
        match = re.match(r"(\s*)([a-z_]+(?:\s*/\s*[a-z_]+)*):\s+(.*)", line)
        indent = len(line) - len(line.lstrip())
        if current and line.strip() and indent > field_indent:  # a continuation, even one like "word: text"
            for name in current:
                docs[name] += " " + line.strip().replace("``", "")
        elif match:
            names = [n.strip() for n in match.group(2).split("/")]
            current, field_indent = names, indent
            for name in names:
                docs[name] = match.group(3).strip().replace("``", "")
        else:
            current = []
    return docs


def _scalar_type(hint: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(python type, choices or None) of a field's type hint: ``int | None`` -> int, ``Literal["a"]`` -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), tuple(args)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _scalar_type(args[0])
    return hint, None


def _unwrap_optional_tuple(hint: Any) -> Any:
    """``tuple[int, ...] | None`` -> ``tuple[int, ...]`` (a list flag left unset stays None; so for str items);
    any other hint as it is (``logit_bias``'s tuple of pairs has its own flag)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is tuple and typing.get_args(args[0])[0] in (int, str):
        return args[0]
    return hint


def _int_list(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> (1, 2, 3), for list-valued flags."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _logit_bias_flag(text: str) -> dict[int, float]:
    """``"12:5,7:-100"`` or the JSON object ``'{"12": 5, "7": -100}'`` -> {12: 5.0, 7: -100.0}, for
    ``--logit-bias`` (``SamplingParams`` checks the ids and the range)."""
    try:
        if text.lstrip().startswith("{"):
            return {int(k): float(v) for k, v in json.loads(text).items()}
        pairs = (part.split(":") for part in text.split(",") if part.strip())
        return {int(token): float(bias) for token, bias in pairs}
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"expected ID:BIAS[,ID:BIAS...] or a JSON object, got {text!r}") from None


def _structured_flag(text: str) -> StructuredOutput:
    """``KIND`` or ``KIND:TEXT`` (``@FILE``: the file's text) -> StructuredOutput, for ``--structured``."""
    kind, _, value = text.partition(":")
    try:
        if value.startswith("@"):
            value = Path(value[1:]).read_text()
        return StructuredOutput(kind, value)
    except (OSError, InvalidRequestError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_field_flag(group: Any, name: str, hint: Any, default: Any, doc: str, dest: str) -> None:
    """One flag for one attrs field, shaped by its type: bool -> switch, tuple (or an optional one) -> list (a tuple
    of tuples: a repeated list flag), else a typed value."""
    flag, metavar = "--" + name.replace("_", "-"), name.upper()
    hint = _unwrap_optional_tuple(hint)
    if hint is bool and default is True:
        off = "--no-" + name.removeprefix("enable_").replace("_", "-")
        group.add_argument(off, dest=dest, action="store_false", help=f"turn off {name}: {doc}")
    elif hint is bool:
        group.add_argument(flag, dest=dest, action="store_true", help=doc)
    elif typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is str:
        help_text = f"{doc} (repeat the flag for several)"
        group.add_argument(flag, dest=dest, action="append", default=None, metavar="TEXT", help=help_text)
    elif typing.get_origin(hint) is tuple and typing.get_origin(typing.get_args(hint)[0]) is tuple:
        help_text = f"{doc} (one sequence per flag; repeat the flag for several)"
        group.add_argument(flag, dest=dest, type=_int_list, action="append", metavar="ID[,ID...]", help=help_text)
    elif typing.get_origin(hint) is tuple:
        group.add_argument(flag, dest=dest, type=_int_list, default=None, metavar="ID[,ID...]", help=doc)
    elif name == "logit_bias":
        help_text = f'{doc} As ID:BIAS[,ID:BIAS...] or a JSON object {{"ID": BIAS}}'
        group.add_argument(flag, dest=dest, type=_logit_bias_flag, default=None, metavar="ID:BIAS", help=help_text)
    elif _scalar_type(hint)[0] is StructuredOutput:
        help_text = f"{doc} As KIND or KIND:TEXT, TEXT inline or @FILE: json_object, json_schema:@schema.json, "
        help_text += "regex:'[0-9]+', choice:'[\"yes\", \"no\"]', grammar:@file.gbnf"
        group.add_argument(flag, dest=dest, type=_structured_flag, default=None, metavar="KIND[:TEXT]", help=help_text)
    else:
        kind, choices = _scalar_type(hint)
        help_text = doc if default is None else f"{doc} (default: {default})"
        group.add_argument(
            flag, dest=dest, type=kind, choices=choices, default=default, metavar=metavar, help=help_text
        )


def _add_attrs_flags(group: Any, cls: type, prefix: str, defaults: dict[str, Any], renames: dict[str, str]) -> None:
    """A flag per init field of the attrs class ``cls``; values land in ``args.<prefix><field>``."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in attrs.fields(cls):
        if not field.init:
            continue
        name = renames.get(field.name, field.name)
        default = defaults.get(field.name, field.default)
        doc = docs.get(field.name) or _EXTRA_DOCS.get(field.name) or f"{cls.__name__}.{field.name}"
        _add_field_flag(group, name, hints[field.name], default, doc, dest=prefix + field.name)


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """One flag per ``SamplingParams`` field (``--temperature``, ``--top-k``, ``--stop`` …); ``defaults`` override
    the CLI's defaults (``CLI_SAMPLING_DEFAULTS``, then the field's own)."""
    group = parser.add_argument_group("sampling (SamplingParams; one set for every prompt)")
    _add_attrs_flags(group, SamplingParams, "sp_", {**CLI_SAMPLING_DEFAULTS, **(defaults or {})}, {})


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """One flag per ``EngineConfig`` field (``--block-size``, ``--dtype``, ``--no-prefix-caching`` …); values land in
    ``args.ec_<field>``. ``defaults``: the subcommand's own defaults where they differ from EngineConfig's (None:
    resolved later by the subcommand)."""
    group = parser.add_argument_group("engine (EngineConfig)")
    _add_attrs_flags(group, EngineConfig, "ec_", defaults or {}, _ENGINE_FLAG_NAMES)


def _collect(args: argparse.Namespace, prefix: str, cls: type) -> dict[str, Any]:
    """The flags stored under ``prefix``, by field name of ``cls``; a list flag left unset (None where the field's
    default is not) is left out, so the field keeps its default."""
    defaults = {f.name: f.default for f in attrs.fields(cls) if f.init}
    values = {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix)}
    return {k: v for k, v in values.items() if v is not None or defaults.get(k) is None}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` from the sampling flags; an out-of-range value is a usage error."""
    try:
        return SamplingParams(**_collect(args, "sp_", SamplingParams))
    except (InvalidRequestError, TypeError) as e:
        raise CLIError(str(e), code=2) from e


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as ``LLM(**options)`` keywords, validated by ``EngineConfig``."""
    options = _collect(args, "ec_", EngineConfig)
    try:
        EngineConfig.from_options(options)
    except (InvalidConfigError, TypeError, ValueError) as e:
        raise CLIError(str(e), code=2) from e
    return options


def missing_folder(path: Path) -> str:
    """Why ``path`` is not a checkpoint folder, in words: "is a file, not a folder" or "does not exist"."""
    return (
        "is a file, not a folder (a checkpoint is a folder holding config.json)" if path.exists() else "does not exist"
    )


def load_llm(model: str | Path | None, options: dict[str, Any], tokenizer: str | None = None) -> Any:
    """``LLM(model, tokenizer=tokenizer, **options)`` (model None = the embedded demo model; tokenizer None = the
    model folder's); load failures become one-line errors: a broken or missing checkpoint or tokenizer exits 1, an
    option the model or machine cannot take exits 2."""
    from fnvllm.demo import model_path

    if options.get("device") == "cuda":
        _require_cuda()
    folder = Path(model) if model is not None else model_path()
    if not folder.is_dir():
        raise CLIError(f"model folder {str(folder)!r} {missing_folder(folder)}", code=1)
    from fnvllm.engine.text import MissingTokenizerError
    from fnvllm.kernels.backends import BackendUnavailableError
    from fnvllm.llm import LLM
    from fnvllm.model.config import CheckpointError

    try:
        return LLM(folder, tokenizer=tokenizer, **options)
    except MissingTokenizerError as e:  # its own advice names LLM's arguments; the CLI's flag here
        raise CLIError(f"{e.folder} holds no tokenizer files; pass --tokenizer FOLDER", code=1) from e
    except (CheckpointError, OSError) as e:  # a missing, broken or mismatched checkpoint file
        raise CLIError(str(e), code=1) from e
    except (InvalidConfigError, BackendUnavailableError, TypeError, ValueError) as e:
        raise CLIError(str(e), code=2) from e


def _require_cuda() -> None:
    """Fail early, in one line, when ``--device cuda`` is asked for on a machine torch sees no GPU on."""
    import torch

    if not torch.cuda.is_available():
        raise CLIError("--device cuda: torch sees no CUDA device on this machine", code=2)


def run_requests(call: Callable[[], Any]) -> Any:
    """Run ``call`` (a generate/stream/chat call); a request the engine rejects, or a run that fails (NaN logits
    from a broken checkpoint, a dead tensor-parallel worker), becomes a one-line error (``--debug``: traceback)."""
    try:
        return call()
    except (InvalidRequestError, ValueError, TypeError) as e:
        raise CLIError(f"request rejected: {e}", code=1) from e
    except RuntimeError as e:
        raise CLIError(f"generation failed: {type(e).__name__}: {e}", code=1) from e


def tolerating_closed_stdout(body: Callable[[], int]) -> int:
    """Run ``body``; when stdout's reader goes away (``fnvllm generate … | head``) stop quietly with 141
    (128 + SIGPIPE, what shell tools exit with) instead of a BrokenPipeError traceback."""
    try:
        return body()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's final flush must not fail too
        return 141


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser``'s own errors (a bad flag value) one line on stderr, pointing at ``--help``; exit 2."""

    def error(message: str) -> typing.NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


class RunStats:
    """Counters of one CLI run, read from ``llm.stats`` before and after, for the closing summary line."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.before = attrs.asdict(llm.stats) if attrs.has(type(llm.stats)) else vars(llm.stats).copy()

    def delta(self, name: str) -> int:
        """How much the counter ``name`` of ``llm.stats`` grew during the run."""
        return int(getattr(self.llm.stats, name)) - int(self.before[name])


def summary_line(stats: RunStats, num_requests: int, seconds: float, ttfts: Sequence[float] = ()) -> str:
    """One line: requests, generated tokens, tok/s, prefix-cache hit tokens, preemptions (and mean TTFT)."""
    tokens = stats.delta("num_generated_tokens")
    parts = [
        f"{num_requests} request{'s' * (num_requests != 1)}",
        f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tok/s)",
        f"prefix-cache hits {stats.delta('num_cached_tokens')} tokens",
        f"preemptions {stats.delta('num_preemptions')}",
    ]
    if ttfts:
        parts.append(f"mean TTFT {1000 * sum(ttfts) / len(ttfts):.0f} ms")
    return " | ".join(parts)


def print_summary(line: str) -> None:
    """The summary goes to stderr, so ``--json`` output on stdout stays machine-readable."""
    print(line, file=sys.stderr, flush=True)


def _token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text (its id in angle brackets without a tokenizer)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"


def logprobs_json(entries: Sequence[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Per generated token: its id, text, log-probability, and the top alternatives as [id, text, logprob]."""
    return [
        {
            "token_id": e.token_id,
            "token": _token_text(tokenizer, e.token_id),
            "logprob": e.logprob,
            "top": [[i, _token_text(tokenizer, i), lp] for i, lp in e.top],
        }
        for e in entries
    ]


def output_json(index: int, out: Any, tokenizer: Any) -> dict[str, Any]:
    """One request's output as a JSON-ready dict (text, ids, finish reason, timings, logprobs)."""
    record: dict[str, Any] = {
        "index": index,
        "request_id": out.request_id,
        "prompt": out.prompt,
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
    }
    if out.metrics is not None:
        m = out.metrics
        record.update(num_cached_tokens=m.num_cached_tokens, ttft_s=m.ttft, e2e_s=m.e2e_latency)
        record["tpot_s"] = m.tpot(len(out.token_ids))
    if out.logprobs is not None:
        record["logprobs"] = logprobs_json(out.logprobs, tokenizer)
    if out.prompt_logprobs is not None:  # the first prompt token has none (nothing before it): null
        scored = logprobs_json([e for e in out.prompt_logprobs if e is not None], tokenizer)
        record["prompt_logprobs"] = [None if e is None else scored.pop(0) for e in out.prompt_logprobs]
    return record


def request_header(index: int, detail: str = "") -> str:
    """The line that opens request ``index`` when a run prints several."""
    return f"===== request {index}{' (' + detail + ')' if detail else ''} ====="


def print_text_outputs(outputs: Sequence[Any], tokenizer: Any, show_prompt: bool = True) -> None:
    """Each output as readable text: (a header when there are several,) the prompt and its continuation."""
    for index, out in enumerate(outputs):
        if len(outputs) > 1:
            print(request_header(index, f"{len(out.token_ids)} tokens, {out.finish_reason}"))
        print(((out.prompt or "") if show_prompt else "") + out.text)
        scored_prompt = [e for e in out.prompt_logprobs or () if e is not None]
        if scored_prompt:
            print("  prompt logprobs (from its second token):")
            _print_logprobs(logprobs_json(scored_prompt, tokenizer))
        if out.logprobs:
            if scored_prompt:  # two lists: label the second too
                print("  logprobs:")
            _print_logprobs(logprobs_json(out.logprobs, tokenizer))
    sys.stdout.flush()


def _print_logprobs(entries: list[dict[str, Any]]) -> None:
    """One line per token: its text, logprob and the top alternatives."""
    for e in entries:
        alternatives = ", ".join(f"{t!r} {lp:.2f}" for _, t, lp in e["top"])
        print(f"  {e['token']!r:>16} {e['logprob']:8.3f}" + (f"   top: {alternatives}" if alternatives else ""))
