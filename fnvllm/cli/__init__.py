"""The ``fnvllm`` command: one entry point, one subcommand per module of this package.

Each module ``fnvllm/cli/<name>.py`` that defines ``register(subparsers)`` adds its subcommand (a new
subcommand is a new module, nothing else to edit). ``register`` adds a parser and sets ``func`` to a callable
``(args) -> int | None`` (the exit code; None means 0).

User mistakes raise ``CLIError``: ``main`` prints its message as one line on stderr and exits with its code
(2 for usage, 1 for runtime); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code ``code`` (2 = bad usage, 1 = runtime failure)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _subcommand_modules() -> list[str]:
    """Names of this package's public modules, sorted (each may register a subcommand)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    """The ``fnvllm`` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="fnvllm", description="fnvllm: LLM inference with a pure scheduler")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _subcommand_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fnvllm`` command; returns the exit code (also used by ``sys.exit``)."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"fnvllm {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


def entry_point() -> None:
    """The console script: ``sys.exit(main())``."""
    sys.exit(main())
