"""``fnvllm generate [MODEL] PROMPT…``: generate from a checkpoint folder (default: the embedded demo model)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.cli import CLIError
from fnvllm.cli._common import (
    CLI_SAMPLING_DEFAULTS,
    RunStats,
    add_engine_args,
    add_sampling_args,
    engine_options,
    load_llm,
    logprobs_json,
    missing_folder,
    one_line_errors,
    output_json,
    print_summary,
    print_text_outputs,
    request_header,
    run_requests,
    sampling_params,
    summary_line,
    tolerating_closed_stdout,
)
from fnvllm.engine.beam import BeamSearchOutput, BeamSearchParams
from fnvllm.state import InvalidRequestError, SamplingParams

Conversation = list[dict[str, str]]
PromptItem = str | Conversation  # a text prompt, or (JSONL with --chat) a whole conversation

DESCRIPTION = """\
Generate text for each prompt and print it (the prompt, then its continuation).

MODEL is a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files); without it the embedded
demo model is used, a tiny Qwen3 that writes Python. The first argument is taken as MODEL when it is an existing
folder (or use --model); every other argument is a prompt. '-' reads prompts from stdin.

Prompt files (--prompts-file, or stdin) hold one prompt per line, or JSON Lines whose objects have a "prompt"
string (with --chat, a "messages" list of {"role", "content"} objects instead).

--n N samples N completions of each prompt (with --seed S, completion j draws from seed S + j): text output
prints each under its own header ("request I (completion J, ...)"); --json prints one object per prompt, its
top-level fields completion 0's, with a "completions" list; --stream prints them one after another, labelled
the same way (with --json, each delta names its "completion").

--beam-width W runs a beam search (LLM.beam_search, vLLM's rules) instead of sampling: each prompt's W beams are
printed best first, each under a header with its cum_logprob (--json: one object per prompt with a "beams" list).
It honours --max-tokens, --temperature, --ignore-eos and --length-penalty; other sampling flags are refused.
"""

EPILOG = """\
examples:
  fnvllm generate "def fib("
  fnvllm generate --temperature 0.8 --top-p 0.95 --seed 1 --max-tokens 100 "class Stack:"
  fnvllm generate --n 3 --temperature 0.8 --seed 1 --max-tokens 32 "def add("
  fnvllm generate --beam-width 4 --length-penalty 0.5 --max-tokens 16 "def add("
  fnvllm generate path/to/Qwen3-0.6B --chat "What is a KV cache?"
  printf 'import os\\nfor i in range(\\n' | fnvllm generate --json -

exit status: 0 on success, 1 when the run fails (missing model, unreadable file, a prompt the model cannot take),
2 for bad usage (an unknown flag or a value out of range). The summary line goes to stderr.
"""


def register(sub: Any) -> None:
    """Add the ``generate`` subcommand."""
    gen = sub.add_parser(
        "generate",
        help="generate from a checkpoint folder (default: the embedded demo model)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    one_line_errors(gen)
    gen.add_argument("inputs", nargs="*", metavar="[MODEL] PROMPT", help="optional model folder, then prompts")
    gen.add_argument("--model", help="checkpoint folder (instead of the first argument)")
    gen.add_argument("--tokenizer", metavar="FOLDER", help="load the tokenizer from FOLDER (default: the model folder)")
    gen.add_argument("--prompts-file", metavar="FILE", help="read prompts from FILE ('-' = stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request (JSON Lines)")
    gen.add_argument(
        "--beam-width", type=int, metavar="W", help="beam search with W beams (in [1, 10]) instead of sampling"
    )
    gen.add_argument(
        "--length-penalty",
        type=float,
        metavar="X",
        help="with --beam-width: score = cum_logprob / length ** X (default 1)",
    )
    gen.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
    )
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Read the prompts, load the model, generate (or stream), print, summarise."""
    return tolerating_closed_stdout(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """``run``'s body."""
    if args.system is not None and not args.chat:
        raise CLIError("--system needs --chat", code=2)
    model, items = gather_prompts(args)
    if args.chat:
        items = [_conversation(item, args.system) for item in items]
    elif any(not isinstance(item, str) for item in items):
        raise CLIError('a "messages" prompt needs --chat', code=2)
    params = sampling_params(args)
    if args.stream and (params.logprobs is not None or params.prompt_logprobs is not None):
        raise CLIError("--logprobs / --prompt-logprobs print with the whole output: drop --stream", code=2)
    beam = _beam_params(args, params)
    llm = load_llm(model, engine_options(args), tokenizer=args.tokenizer)
    stats, start = RunStats(llm), time.perf_counter()
    if beam is not None:
        ttfts = _beam_search(llm, items, beam, params.skip_special_tokens, args)
    else:
        ttfts = _stream(llm, items, params, args) if args.stream else _generate(llm, items, params, args)
    print_summary(summary_line(stats, len(items), time.perf_counter() - start, ttfts))
    return 0


def _generate(llm: Any, items: list[PromptItem], params: Any, args: argparse.Namespace) -> list[float]:
    """Generate all, print them (text or JSON Lines); returns each request's time to first token."""
    if args.chat:
        outputs = run_requests(lambda: llm.chat(items, params, use_tqdm=False))
    else:
        outputs = run_requests(lambda: llm.generate(items, params, use_tqdm=False))
    if args.json:
        for index, out in enumerate(outputs):
            print(json.dumps(_record(index, out, llm.tokenizer)), flush=True)
    elif params.n > 1:
        _print_completions(outputs, llm.tokenizer, show_prompt=not args.chat)
    else:
        print_text_outputs(outputs, llm.tokenizer, show_prompt=not args.chat)
    metrics = [out.metrics for out in outputs if out.metrics is not None]
    return [m.ttft for m in metrics if m.ttft is not None]


BEAM_FLAGS = ("temperature", "max_tokens", "ignore_eos", "skip_special_tokens")
"""The sampling fields beam search honours (skip_special_tokens: in the printed text); any other flag is refused."""


def _beam_params(args: argparse.Namespace, params: SamplingParams) -> BeamSearchParams | None:
    """The search --beam-width asks for (None without it); a usage error naming both flags when another flag asks
    for what beam search cannot do, or naming --length-penalty without --beam-width."""
    if args.beam_width is None:
        if args.length_penalty is not None:
            raise CLIError("--length-penalty needs --beam-width", code=2)
        return None
    defaults = SamplingParams(**CLI_SAMPLING_DEFAULTS)
    changed = [
        f.name for f in attrs.fields(SamplingParams) if f.init and getattr(params, f.name) != getattr(defaults, f.name)
    ]
    refused = ["stream"] * args.stream + [name for name in changed if name not in BEAM_FLAGS]
    if refused:
        flag = "--" + refused[0].replace("_", "-")
        raise CLIError(f"--beam-width and {flag} cannot be combined: beam search does not honour {flag}", code=2)
    penalty = 1.0 if args.length_penalty is None else args.length_penalty
    try:
        return BeamSearchParams(args.beam_width, params.max_tokens, params.ignore_eos, params.temperature, penalty)
    except InvalidRequestError as e:
        raise CLIError(str(e).replace("BeamSearchParams.", "--").replace("_", "-", 1), code=2) from e


def _beam_search(
    llm: Any, items: list[PromptItem], beam: BeamSearchParams, skip: bool, args: argparse.Namespace
) -> list[float]:
    """Beam-search every prompt (a conversation through the chat template) and print each one's beams, best
    first: under a header with their cum_logprob (text), or one JSON object per prompt with a "beams" list."""
    prompts = [_render(llm, item) for item in items]
    outputs = run_requests(lambda: llm.beam_search(prompts, beam, use_tqdm=False))
    for index, (item, out) in enumerate(zip(items, outputs, strict=True)):
        shown = item if isinstance(item, str) and not args.chat else ""
        if args.json:
            print(json.dumps(_beams_record(index, out, llm.tokenizer, skip)), flush=True)
            continue
        for rank, seq in enumerate(out.sequences):
            detail = f"beam {rank}, {len(seq.output_token_ids)} tokens, {seq.finish_reason}"
            print(request_header(index, f"{detail}, cum_logprob {seq.cum_logprob:.4f}"))
            print(shown + _answer(seq, llm.tokenizer, skip))
    return []


def _beams_record(index: int, out: BeamSearchOutput, tokenizer: Any, skip: bool) -> dict[str, Any]:
    """One prompt's beams as a JSON-ready dict, best first."""
    beams = [
        {"text": _answer(seq, tokenizer, skip), "token_ids": list(seq.output_token_ids),
         "cum_logprob": seq.cum_logprob, "finish_reason": seq.finish_reason}
        for seq in out.sequences
    ]  # fmt: skip
    return {"index": index, "prompt": out.prompt, "num_prompt_tokens": len(out.prompt_token_ids), "beams": beams}


def _answer(seq: Any, tokenizer: Any, skip: bool) -> str:
    """A beam's text: its generated ids less an EOS id that ended it (as the server's choices), decoded."""
    return str(tokenizer.decode(list(seq.answer_token_ids), skip_special_tokens=skip)) if tokenizer is not None else ""


def _record(index: int, out: Any, tokenizer: Any) -> dict[str, Any]:
    """One prompt's output as a JSON-ready dict (``output_json``: completion 0's), with a "completions" list of
    every completion when there are several."""
    record = output_json(index, out, tokenizer)
    if len(out.outputs) > 1:
        record["completions"] = [_completion_record(c, tokenizer) for c in out.outputs]
    return record


def _completion_record(completion: Any, tokenizer: Any) -> dict[str, Any]:
    """One completion as a JSON-ready dict: index, text, ids, finish reason (and logprobs with their sum)."""
    record: dict[str, Any] = {"index": completion.index, "text": completion.text}
    record.update(token_ids=list(completion.token_ids), finish_reason=completion.finish_reason)
    if completion.logprobs is not None:
        record["logprobs"] = logprobs_json(completion.logprobs, tokenizer)
        record["cumulative_logprob"] = completion.cumulative_logprob
    return record


def _print_completions(outputs: Sequence[Any], tokenizer: Any, show_prompt: bool) -> None:
    """Every completion of every prompt as text, each under a header naming its request and completion (the prompt's
    logprobs, when asked, under completion 0)."""
    for index, out in enumerate(outputs):
        for c in out.outputs:
            print(request_header(index, f"completion {c.index}, {len(c.token_ids)} tokens, {c.finish_reason}"))
            scored = out.prompt_logprobs if c.index == 0 else None
            one = attrs.evolve(
                out, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason, logprobs=c.logprobs,
                prompt_logprobs=scored, outputs=(c,),
            )  # fmt: skip
            print_text_outputs([one], tokenizer, show_prompt)


def _stream(llm: Any, items: list[PromptItem], params: Any, args: argparse.Namespace) -> list[float]:
    """Stream all, printing deltas as they come (text in prompt order, or one JSON object per delta)."""
    prompts = [_render(llm, item) for item in items]
    shown = [item if isinstance(item, str) and not args.chat else "" for item in items]
    printer = StreamPrinter(shown, as_json=args.json, num_completions=params.n)
    run_requests(lambda: printer.print_all(llm.stream(prompts, params)))
    return []


def _render(llm: Any, item: PromptItem) -> str | tuple[int, ...]:
    """A prompt as ``LLM.stream`` takes it: its text, or a conversation's token ids through the chat template
    (encoded as ``LLM.chat`` does, without a second BOS)."""
    if isinstance(item, str):
        return item
    return run_requests(lambda: llm.encode_chat(item))[1]  # type: ignore[no-any-return]


def _conversation(item: PromptItem, system: str | None) -> Conversation:
    """A prompt as a chat conversation: one user message (after the system message, if any)."""
    if not isinstance(item, str):
        return item
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": item}]


def gather_prompts(args: argparse.Namespace) -> tuple[str | None, list[PromptItem]]:
    """(model folder or None, prompts) from the positional arguments, --prompts-file and stdin, in that order."""
    has_file = args.prompts_file is not None
    model, prompts = split_model(args.inputs, args.model, has_file or "-" in args.inputs)
    items: list[PromptItem] = []
    for prompt in prompts:
        items.extend(read_prompts("-") if prompt == "-" else [prompt])
    if has_file:
        items.extend(read_prompts(args.prompts_file))
    if not items:
        raise CLIError("no prompt given: pass PROMPT arguments, --prompts-file FILE, or '-' for stdin", code=2)
    return model, items


def split_model(inputs: list[str], model_flag: str | None, other_sources: bool) -> tuple[str | None, list[str]]:
    """Tell the optional MODEL argument from the prompts.

    The first argument is the model when it is an existing folder. When it looks like a path (no spaces, a '/'
    in it) and prompts come from elsewhere too, a missing folder is an error rather than a strange prompt."""
    if model_flag is not None or not inputs:
        return model_flag, inputs
    first = inputs[0]
    if _is_dir(first):
        return str(Path(first).expanduser()), inputs[1:]
    looks_like_path = "/" in first and not any(c.isspace() for c in first)
    if looks_like_path and (len(inputs) > 1 or other_sources):
        raise CLIError(f"model folder {first!r} {missing_folder(Path(first).expanduser())}", code=1)
    return None, inputs


def _is_dir(text: str) -> bool:
    """True when ``text`` names an existing folder (False for text no path can be: too long, NUL bytes)."""
    try:
        return Path(text).expanduser().is_dir()
    except (OSError, ValueError):
        return False


def read_prompts(source: str) -> list[PromptItem]:
    """The prompts of a file (or of stdin for '-'): one per line, or JSON Lines; blank lines are skipped."""
    name = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read prompts from {name}: {e}", code=1) from e
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if numbered and numbered[0][1].lstrip().startswith("{"):
        return [_jsonl_prompt(line, f"{name}:{n}") for n, line in numbered]
    return [line for _, line in numbered]


def _jsonl_prompt(line: str, where: str) -> PromptItem:
    """One JSON Lines record: {"prompt": str} or {"messages": [{"role", "content"}, …]}."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise CLIError(f"{where}: not valid JSON ({e})", code=1) from e
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return str(record["prompt"])
    messages = record.get("messages") if isinstance(record, dict) else None
    if isinstance(messages, list) and all(_is_message(m) for m in messages) and messages:
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise CLIError(f'{where}: expected an object with a "prompt" string or a "messages" list', code=1)


def _is_message(value: Any) -> bool:
    """True for a chat message: a dict with string "role" and "content"."""
    return isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)


class StreamPrinter:
    """Prints streamed deltas. Text: sequences in prompt order (a prompt's ``num_completions`` completions one
    after another, each under its own header), each shown live once the ones before it are done (later ones' text
    waits in a buffer, so outputs never interleave). JSON: one object per delta, at once."""

    def __init__(self, prompts: Sequence[str], as_json: bool, num_completions: int = 1) -> None:
        self.prompts, self.as_json, self.num_completions = list(prompts), as_json, num_completions
        num_sequences = len(self.prompts) * num_completions  # sequence s: prompt s // n, completion s % n
        self.buffers: list[list[str]] = [[] for _ in range(num_sequences)]
        self.done = [False] * num_sequences
        self.current = 0
        if not as_json:
            self._open(0)

    def print_all(self, deltas: Iterable[Any]) -> None:
        """Print every delta of a stream as it comes."""
        for delta in deltas:
            self.add(delta)

    def add(self, delta: Any) -> None:
        """Take one delta (``StreamDelta``) and print what can be printed now."""
        if self.as_json:
            record = {"index": delta.index, "completion": delta.completion, "request_id": delta.request_id}
            record.update(text=delta.new_text, token_ids=list(delta.new_token_ids), finish_reason=delta.finish_reason)
            print(json.dumps(record), flush=True)
            return
        sequence = delta.index * self.num_completions + delta.completion
        self.buffers[sequence].append(delta.new_text)
        self.done[sequence] |= delta.finish_reason is not None
        self._flush()

    def _open(self, sequence: int) -> None:
        """Start printing ``sequence``: its header (when there are several) and its prompt."""
        index, completion = divmod(sequence, self.num_completions)
        if self.num_completions > 1:
            print(request_header(index, f"completion {completion}"))
        elif len(self.prompts) > 1:
            print(request_header(index))
        sys.stdout.write(self.prompts[index])

    def _flush(self) -> None:
        """Print the current sequence's buffered text; move on past every finished one."""
        while self.current < len(self.buffers):
            sys.stdout.write("".join(self.buffers[self.current]))
            self.buffers[self.current].clear()
            if not self.done[self.current]:
                break
            sys.stdout.write("\n")
            self.current += 1
            if self.current < len(self.buffers):
                self._open(self.current)
        sys.stdout.flush()
