"""``fnvllm serve [MODEL]``: an OpenAI-compatible HTTP server (needs the ``[serve]`` extra).

Without MODEL it serves the embedded demo model, or (if the package has none) a tiny random Qwen3 written to a
temp folder. ``--port 0`` picks a free port; the line ``listening on http://HOST:PORT`` says which.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from fnvllm.cli import CLIError
from fnvllm.cli._common import add_engine_args, engine_options, one_line_errors

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # fnvllm.serve.limits' default (that module needs the [serve] extra)
DEFAULT_HEALTH_STALL_S = 300.0  # fnvllm.serve.app's default (tests/test_serve_health_metrics.py checks they agree)


def _tiny_random_model() -> Path:
    """A tiny random Qwen3 checkpoint + test tokenizer in a temp folder (gibberish, but the full stack runs)."""
    from fnvllm.testing.checkpoints import write_tiny_checkpoint
    from fnvllm.testing.tokenizer import build_test_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="fnvllm-serve-"))
    write_tiny_checkpoint(
        folder, "qwen3", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512,
        intermediate_size=256, tie_word_embeddings=True,
    )  # fmt: skip
    build_test_tokenizer(folder, vocab_size=512)
    return folder


def _resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The checkpoint folder to serve and its default served name."""
    if args.model is not None:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise CLIError(f"{args.model} is not a checkpoint folder (no config.json)", code=2)
        return path, args.model
    try:
        from fnvllm.demo import model_path

        return model_path(), "fnvllm-demo"
    except (ImportError, OSError):
        path = _tiny_random_model()
        print(f"fnvllm serve: no demo model in this install; serving a tiny random Qwen3 from {path}", flush=True)
        return path, "tiny-random-qwen3"


def _start_engine(args: argparse.Namespace, path: Path) -> tuple[Any, str, str, Any, bool]:
    """The engine front, and (device, attention backend, core config, has tokenizer) to announce. By default the
    engine runs in a process of its own (``ProcessEngine``); ``--engine-thread`` keeps it on a thread here."""
    from fnvllm.config import EngineConfig
    from fnvllm.engine.build import build_engine
    from fnvllm.engine.text import has_tokenizer_files, load_local_tokenizer
    from fnvllm.serve import AsyncEngine, ProcessEngine

    # A random benchmark checkpoint has no tokenizer files: the server then runs without one (token-id prompts
    # in, ``token_ids`` out) rather than an empty placeholder tokenizer that decodes every id to "".
    options, has_tokenizer = engine_options(args), has_tokenizer_files(path)
    if args.engine_thread:
        parts = build_engine(path, EngineConfig.from_options(options), load_tokenizer=has_tokenizer)
        backend = getattr(parts.executor.backend, "name", parts.executor.backend)
        engine = AsyncEngine(parts.loop, parts.tokenizer, max_waiting=args.max_waiting)
        return engine, str(parts.executor.device), backend, parts.engine.config, parts.tokenizer is not None
    tokenizer = load_local_tokenizer(path) if has_tokenizer else None
    engine = ProcessEngine(path, options, tokenizer, has_tokenizer, max_waiting=args.max_waiting)
    ready = engine.ready
    return engine, ready.device, ready.backend, ready.config, ready.has_tokenizer


MAX_PORT = 65535
MAX_STREAM_INTERVAL_MS = 60_000.0


# ``fnvllm.serve.tool_parsers.TOOL_PARSERS``' names, spelled out so that ``--help`` needs no [serve] extra
# (tests/test_server_limits.py checks that the two agree).
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")


def seconds_or_none(text: str) -> float | None:
    """``--health-stall-s``'s value: a number of seconds, or ``none`` (no stall check)."""
    return None if text.strip().lower() == "none" else float(text)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse out-of-range serve flags (exit 2, one line naming the flag) before anything is loaded."""
    from fnvllm.serve.app import check_health_stall_s
    from fnvllm.serve.limits import MAX_REQUEST_BYTES_LIMIT

    if not 0 <= args.port <= MAX_PORT:
        raise CLIError(f"--port must be in [0, {MAX_PORT}] (0: any free port), got {args.port}", code=2)
    if args.max_waiting is not None and args.max_waiting < 1:
        raise CLIError(f"--max-waiting must be >= 1 (leave it out for no cap), got {args.max_waiting}", code=2)
    if not 0 <= args.stream_interval_ms <= MAX_STREAM_INTERVAL_MS:  # also refuses nan
        raise CLIError(
            f"--stream-interval-ms must be in [0, {MAX_STREAM_INTERVAL_MS:.0f}], got {args.stream_interval_ms}", code=2
        )
    if not 1 <= args.max_request_bytes <= MAX_REQUEST_BYTES_LIMIT:
        raise CLIError(
            f"--max-request-bytes must be in [1, {MAX_REQUEST_BYTES_LIMIT}], got {args.max_request_bytes}", code=2
        )
    try:
        check_health_stall_s(args.health_stall_s, "--health-stall-s")
    except ValueError as error:
        raise CLIError(str(error), code=2) from None
    for flag, value in (("--host", args.host), *(("--served-model-name", n) for n in args.served_model_name or ())):
        if value is not None and not value.strip():
            raise CLIError(f"{flag} must not be empty", code=2)
    if args.api_key is not None and not args.api_key.strip():  # an empty key would turn authentication off
        raise CLIError("--api-key (or $FNVLLM_API_KEY) must not be empty; unset it to serve without a key", code=2)


def _reserve_port(args: argparse.Namespace) -> Any:
    """The socket bound to --host:--port (not listening yet: connections are refused until the model is loaded)."""
    from fnvllm.serve.server import bind

    try:
        return bind(args.host, args.port, listen=False)
    except OSError as error:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {error}") from None


def _stop_quietly(engine: Any) -> None:
    """Stop a loaded engine whose server could not start (its process, or its thread), ignoring its errors."""
    with contextlib.suppress(Exception):  # already failing: the listen error is the one to report
        engine.stop()


def run(args: argparse.Namespace) -> int:
    """Check the flags, load the model, then serve until SIGINT/SIGTERM (exit 0)."""
    try:
        from fnvllm.serve import EngineStartupError, EngineStoppedError, serve
    except ImportError as error:
        raise CLIError(f"fnvllm serve needs the [serve] extra (pip install 'fnvllm[serve]'): {error}") from None
    check_flags(args)
    engine_options(args)  # validated by EngineConfig: a bad value exits 2 here, naming the field

    path, default_name = _resolve_model(args)
    name, *aliases = args.served_model_name or [default_name]
    sock = _reserve_port(args)  # a port in use is an error now, not after minutes of loading
    try:
        engine, device, backend, cfg, has_tokenizer = _start_engine(args, path)
    except (OSError, ValueError, TypeError, EngineStartupError) as error:
        sock.close()
        raise CLIError(f"cannot load {path}: {error}") from None
    print(
        f"fnvllm serve: model {name!r} from {path}: device {device}, attention {backend}, "
        f"{cfg.num_blocks} KV blocks of {cfg.block_size} tokens, max_model_len {engine.max_total_tokens}"
        + (f" (the KV pool's; the model's {cfg.max_model_len})" if engine.max_total_tokens < cfg.max_model_len else "")
        + ("" if args.engine_thread else " (engine in its own process)"),
        flush=True,
    )
    if not has_tokenizer:
        print(f"fnvllm serve: no tokenizer files in {path}: token-id prompts only; choices carry token_ids", flush=True)

    def announce(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"fnvllm serve: listening on http://{shown}:{port}", flush=True)

    try:
        serve(
            engine,
            name,
            args.host,
            args.port,
            args.api_key,
            args.log_level,
            on_listening=announce,
            stream_interval_s=args.stream_interval_ms / 1e3,
            max_request_bytes=args.max_request_bytes,
            sock=sock,
            reasoning_parser=args.reasoning_parser,
            tool_parser=args.tool_call_parser,
            model_aliases=aliases,
            health_stall_s=args.health_stall_s,
        )
    except OSError as error:
        _stop_quietly(engine)
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {error}") from None
    except EngineStoppedError as error:
        raise CLIError(f"{error} (exit 1, so that a supervisor restarts it)") from None
    print("fnvllm serve: stopped", file=sys.stderr, flush=True)
    return 0


def register(sub: Any) -> None:
    """Add the ``serve`` subcommand."""
    p = one_line_errors(sub.add_parser("serve", help="an OpenAI-compatible HTTP server"))
    p.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    key_help = "require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and /metrics "
    key_help += "(default: $FNVLLM_API_KEY)"
    p.add_argument("--api-key", default=os.environ.get("FNVLLM_API_KEY"), help=key_help)
    name_help = "the model name clients send (default: MODEL as given; fnvllm-demo for the demo model); several "
    name_help += "names: any is accepted, the first is the one responses carry"
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help=name_help)
    p.add_argument("--max-waiting", type=int, default=None, help="answer 503 while this many requests wait (>= 1)")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"answer 413 to a larger request body, before reading it (default {DEFAULT_MAX_REQUEST_BYTES}: 8 MiB)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="least time between two chunks of one stream; tokens in between go out together (default 0: every "
        "step). Larger values trade token-by-token latency for throughput at many concurrent streams",
    )
    p.add_argument(
        "--health-stall-s",
        type=seconds_or_none,
        default=DEFAULT_HEALTH_STALL_S,
        metavar="SECONDS",
        help="/health answers 503 when requests are pending and no engine step has completed for this long "
        f"(> 0; 'none': never; default {DEFAULT_HEALTH_STALL_S:g}, above a long prefill or CUDA-graph capture)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3"],
        default=None,
        help="split chat output's <think>...</think> into message.reasoning_content (default: off)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSER_NAMES),
        default="hermes",
        help="the format chat tool calls are parsed from and forced in: hermes (<tool_call>{json}</tool_call>: Qwen, "
        "Hermes; default), llama3_json ({json}; ...: Llama 3.x), mistral ([TOOL_CALLS][{json}, ...], or "
        "[TOOL_CALLS]name[ARGS]{json} per call with v11 tokenizers: Mistral), pythonic ([f(x=1), g()]: Llama 3.2, 4)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice 'auto' is always available here",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the server process instead of a process of its own (one process, "
        "but the web server and the engine then share the GIL)",
    )
    add_engine_args(p)
    # Older spellings of two engine flags, still accepted: --seed (now --engine-seed, as in generate and demo, where
    # --seed is a request's sampling seed) and --no-overlap (now --no-overlap-steps, the field's name).
    p.add_argument("--seed", dest="ec_seed", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--no-overlap", dest="ec_overlap_steps", action="store_false", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
