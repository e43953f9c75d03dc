"""Grammar-constrained rows: xgrammar matchers, one per request life, and the token bitmasks the sampler applies.

``SamplingParams.structured`` (a ``StructuredOutput``) names the constraint; this module is where it meets the
tokenizer. ``Grammars`` compiles each (kind, text) once with xgrammar's GrammarCompiler (a cache) and keeps one
GrammarMatcher per request life. The executor asks it, at launch, for the bitmask of the constrained rows
(``masks``: each row's next allowed tokens given every token committed so far) and hands the sampled tokens back
at collect (``accept``). A matcher ends its request by allowing only the stop (EOS) ids once its grammar is
complete; the core's EOS rule then finishes the request with "stop".

xgrammar is optional: importing this module does not import it; the first constrained request does, and without
it installed that is an InvalidRequestError naming the package (``check_structured`` raises it when the request
is added, before anything runs).

Where the matchers live: on a GPU, in a grammar process of their own (``GrammarProcess``, this module run as
``python -m fnvllm.executor.structured``), which accepts and fills beside the engine loop without sharing its GIL;
on the CPU (or with ``Grammars(process=False)``), in this process.

Overlapped steps: see ``ModelExecutor.launch`` and docs/structured_outputs.md (a step with a constrained row fed
by the step still in flight samples once that step's tokens are accepted; its forward still overlaps). By default
(``ModelExecutor.sample_deferred_at = "launch"``) the collect that brings the tokens hands them over with
``advance`` (to the grammar process, or a grammar thread here), which accepts them and fills the next masks while
the engine loop commits and plans; the next launch receives the masks (``wait``) and samples. With "collect" the
collect accepts and fills itself (``accept``, ``masks``). ``Grammars.stats`` says where the time went.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from fnvllm.state.errors import InvalidRequestError
from fnvllm.state.params import SamplingParams, StructuredOutput
from fnvllm.state.plan import StepPlan

if TYPE_CHECKING:  # the loop imports this module, and the simulator runs the loop without torch
    import torch

    from fnvllm.executor.sampler import HostGrammarMask

# Where the matchers live: a grammar process of their own (True), or this process (False, with ``advance`` on
# worker threads); None: a process where CUDA is available (overlapped steps), else this process. ``Grammars(process=)``
# overrides it per object.
GRAMMAR_PROCESS: bool | None = None
# Split the cores between the engine loop's thread and the grammar process (``_halves``): a socket write wakes the
# reader "synchronously", which Linux places on the writer's core when it may, so the loop would stall behind the
# process's whole accept and fill (measured: 9 ms writes on a 2-core machine, 0.07 ms with the cores split).
SPLIT_CORES = True
PROCESS_WORKERS = 1  # the grammar process's worker threads when Grammars(num_workers=None) (each its chunk of rows)
MASK_SLOTS = 4  # bitmask buffers the grammar process fills in turn (a step's is read by its upload, queued later)
GIL_SWITCH_S = 1e-4  # the GIL switch interval while the grammar worker runs (``Grammars.advance``)
_STRUCTURED = attrgetter("structured")  # a SamplingParams' constraint, in C-level maps
ROWS_PER_FILL_THREAD = 2  # a batched fill uses at most one xgrammar thread per this many rows (``Grammars._batch``)
INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'fnvllm[serve]' (or pip install xgrammar)"


def import_xgrammar() -> Any:
    """The xgrammar module, or InvalidRequestError naming the package when it is not installed."""
    try:
        import xgrammar
    except ImportError as error:
        raise InvalidRequestError(f"SamplingParams.structured: {INSTALL_HINT}") from error
    return xgrammar


def _grammar(xgr: Any, spec: StructuredOutput) -> Any:
    """The xgrammar Grammar of ``spec`` (no tokenizer needed); JSON without free whitespace, so that a weak model
    cannot spend its tokens on blanks."""
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        # Characters as themselves, not as JSON's \u escapes: xgrammar reads an escaped surrogate pair (how JSON
        # writes an emoji) as two characters and would then emit their invalid UTF-8.
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.text))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(spec.text)


def check_structured(params: SamplingParams) -> None:
    """Raise InvalidRequestError (naming the field and the reason) unless ``params.structured`` is None or
    compiles: a bad regex, EBNF or JSON schema is refused when the request is added, never at a step."""
    spec = params.structured
    if spec is None:
        return
    xgr = import_xgrammar()
    try:
        _grammar(xgr, spec)
    except Exception as error:  # xgrammar raises RuntimeError / ValueError subclasses with the parser's message
        field = {"json_object": "json_schema"}.get(spec.kind, spec.kind)
        raise InvalidRequestError(f"SamplingParams.structured ({field}) does not compile: {error}") from error


MAX_FILL_THREADS = 8  # more measured slower on the H200's host (64 rows: 0.88 ms on 8 threads, 1.29 on 15)


def default_fill_threads() -> int:
    """Threads for the mask fills: every core this process may use but one (left to the engine loop, which commits
    and plans while the fill runs), at most MAX_FILL_THREADS (xgrammar starts its threads at every call)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, cores - 1))


class _SwitchInterval:
    """The process's GIL switch interval, lowered to GIL_SWITCH_S while any Grammars' workers run (counted, so that
    two engines in one process restore the original once both are done)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def lower(self) -> None:
        """One more user of the low interval (the first saves the original)."""
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(GIL_SWITCH_S)
            self._users += 1

    def restore(self) -> None:
        """One user fewer (the last puts the original back)."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


@attrs.define(eq=False)
class PendingMask:
    """A step's grammar bitmask, being filled on the grammar worker thread (``Grammars.advance``).

    host: the buffer being filled (and the rows it applies to). work: the workers' accepts and fills, one per chunk
    of rows, whose results are the (id, matcher) pairs whose grammar ended with the accepted tokens; read them
    through ``Grammars.wait``.
    """

    host: HostGrammarMask
    work: tuple[Future[list[tuple[str, Matcher]]], ...]
    ticket: int | None = None  # the grammar process's fill (``Grammars(process=True)``), answered in order


@attrs.define
class GrammarStats:
    """Where the host's grammar time went since the last ``Grammars.reset_stats`` (seconds, summed over steps).

    fill_s / accept_s: inside xgrammar's fill and accept calls (on the grammar workers, or on the caller's thread
    when it fills or accepts itself); num_fills / rows_filled: the fill calls and the rows they filled. wait_s: the
    caller blocked in ``Grammars.wait`` for a fill that had not finished (what the fill adds to the engine loop's
    critical path); num_waits: the waits. With several grammar workers their times add up (and two workers'
    updates may race: the sums are for benchmarks, benchmarks/bench_structured.py, not for accounting).
    """

    fill_s: float = 0.0
    accept_s: float = 0.0
    wait_s: float = 0.0
    num_fills: int = 0
    rows_filled: int = 0
    num_waits: int = 0


@attrs.define(eq=False)
class Matcher:
    """One request life's matcher and how many tokens it has accepted."""

    matcher: Any
    accepted: int = 0


@attrs.define(eq=False)
class RemoteMatcher:
    """One request life's matcher in the grammar process (``Grammars(process=True)``): its number there, how many
    tokens it has been given, and whether its grammar ended (it was given a stop id: the mask allowed one only once
    the grammar was complete, so the matcher there ended with it)."""

    mid: int
    accepted: int = 0
    ended: bool = False


class Grammars:
    """Compiled grammars (cached by (kind, text)) and per-request matchers for one tokenizer.

    tokenizer: the Hugging Face tokenizer of the model; vocab_size: the model's (logits') vocabulary size, which
    may exceed the tokenizer's; stop_ids: the engine's EOS ids (the only ids a complete grammar allows).
    tokenizer_info: an xgrammar TokenizerInfo to use instead of the tokenizer's (benchmarks on checkpoints
    without a tokenizer). num_threads: xgrammar's threads for filling several rows' masks (default: every core
    but one, at most 8: ``default_fill_threads``). num_workers: how many workers split each step's rows, each
    accepting and filling its own chunk (with num_threads / num_workers of xgrammar's threads): the grammar threads
    of ``advance`` here, or threads of the grammar process; None: 1 here, PROCESS_WORKERS there. process: keep
    the matchers in a grammar process of their own (``GrammarProcess``; started with the first constrained row)
    instead of this one; None: GRAMMAR_PROCESS, whose None means a process where CUDA is available (chosen at
    the first constrained row; a running process is used until ``close``). The compiler is built on first use, so
    an engine whose requests are unconstrained never imports xgrammar (nor starts a process).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        tokenizer_info: Any = None,
        num_threads: int | None = None,
        num_workers: int | None = None,
        process: bool | None = None,
    ) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"Grammars.num_threads must be >= 1 (or None: default_fill_threads()), got {num_threads}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"Grammars.num_workers must be >= 1 (or None: the default), got {num_workers}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._stop_set = frozenset(self.stop_ids)
        self.tokenizer_info = tokenizer_info
        self.num_threads = num_threads or default_fill_threads()
        self.num_workers = num_workers  # None: 1 on the grammar thread, PROCESS_WORKERS in a grammar process
        self._pool: ThreadPoolExecutor | None = None  # the grammar worker (``advance``), started on first use
        self._lowered = False  # whether this object holds the GIL switch interval lowered (``advance`` to ``wait``)
        self._compiler: Any = None
        # xgrammar's BatchGrammarMatchers (they fill several rows' masks on threads), one per calling thread (the
        # caller's, the grammar worker's): one object must not fill from two threads at once.
        self._batches: dict[int, Any] = {}
        self._compiled: dict[tuple[str, str], Any] = {}
        self._live: dict[str, Matcher | RemoteMatcher] = {}
        self.process = process
        self._remote: GrammarProcess | None = None
        self.stats = GrammarStats()

    @property
    def uses_process(self) -> bool:
        """Whether the matchers live in a grammar process (``process``, else GRAMMAR_PROCESS, else whether CUDA is
        available: torch is imported by then on an executor that can use it)."""
        choice = GRAMMAR_PROCESS if self.process is None else self.process
        if choice is None:
            torch = sys.modules.get("torch")
            return torch is not None and torch.cuda.is_available()
        return choice

    def _process(self) -> GrammarProcess:
        """The grammar process, started on first use with this object's vocabulary."""
        if self._remote is None:
            xgr = import_xgrammar()
            info = self.tokenizer_info or xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self.tokenizer_info = info
            workers = self.num_workers or PROCESS_WORKERS
            self._remote = GrammarProcess(info.serialize_json(), self.vocab_size, self.num_threads, workers)
        return self._remote

    def close(self) -> None:
        """Stop the grammar process, if one runs (a later constrained row starts another), and forget the live
        matchers: call it once no constrained request runs. Idempotent."""
        if self._remote is not None:
            self._remote.close()
            self._remote = None
            self._live.clear()

    def reset_stats(self) -> GrammarStats:
        """The stats so far; counting starts again from zero."""
        stats, self.stats = self.stats, GrammarStats()
        return stats

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def _compile(self, spec: StructuredOutput) -> Any:
        xgr = import_xgrammar()
        if self._compiler is None:
            info = self.tokenizer_info or xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        key = (spec.kind, spec.text)
        if key not in self._compiled:
            self._compiled[key] = self._compiler.compile_grammar(_grammar(xgr, spec))
        return self._compiled[key]

    def matchers(self, plan: StepPlan, rows: Sequence[int]) -> tuple[Matcher | None, ...]:
        """Per sampled row (``rows``: plan rows, in order), the matcher of its request life, or None when it is
        unconstrained. A row admitted with nothing generated is a new life (an id may be reused): it gets a fresh
        matcher; a preempted request re-admitted with its tokens keeps its own."""
        params = plan.params
        specs = list(map(_STRUCTURED, params)) if len(rows) == len(params) else [params[i].structured for i in rows]
        out: list[Matcher | RemoteMatcher | None] = [None] * len(rows)
        remote = self._remote if self._remote is not None else self._process() if self.uses_process else None
        for k in [k for k, spec in enumerate(specs) if spec is not None]:  # rows are 0..B-1 when they are all
            i, spec = rows[k], specs[k]
            rid = plan.seq_ids[i]
            live = self._live.get(rid)
            if live is None or (i >= plan.num_continuing and plan.num_generated[i] == 0):
                if live is not None and remote is not None and isinstance(live, RemoteMatcher):
                    remote.drop([live])
                if remote is not None:
                    live = remote.new(spec)
                else:
                    live = Matcher(import_xgrammar().GrammarMatcher(self._compile(spec)))
                self._live[rid] = live
            out[k] = live
        return tuple(out)

    def masks(self, matchers: Sequence[Matcher | None], pinned: bool = False) -> HostGrammarMask | None:
        """The bitmask of the constrained rows among ``matchers`` (their positions are the batch rows), filled on the
        calling thread; None when none is constrained. Each row allows the tokens its matcher accepts next; a row
        whose grammar already ended (a speculative row of a request that finished in the step before: its token is
        dropped) allows any. pinned: the buffer is bound for a GPU."""
        if self._remote is not None and _remote_rows(matchers):
            sent = self._remote.fill(matchers, pinned)  # type: ignore[arg-type]
            if sent is None:
                return None
            return self._count_remote(*sent, 0.0)
        host = self._allocate(matchers, pinned)
        if host is not None:
            self._fill(_numbered(matchers), host.bitmask)
        return host

    def advance(
        self,
        seq_ids: Sequence[str],
        matchers: Sequence[Matcher | None],
        tokens: Sequence[int],
        following: Sequence[Matcher | None],
        pinned: bool = False,
    ) -> PendingMask | None:
        """``accept`` a collected step's tokens, then fill the masks of the step that follows it (``following``: its
        rows' matchers, as for ``masks``), on the grammar worker threads: xgrammar accepts and fills without the
        GIL, so the caller goes on (commit, planning) until it needs the mask (``wait``). No matcher may be used
        before then. With ``num_workers`` > 1 the following rows are cut into that many chunks, each accepted then
        filled by its own worker (so the accepts run in parallel too). None when ``following`` has no constrained
        row (the tokens are accepted at once). With a grammar process, both go to it and it does both while the
        caller goes on (``wait`` receives the mask)."""
        if self._remote is not None and (_remote_rows(matchers) or _remote_rows(following)):
            self.accept(seq_ids, matchers, tokens)
            sent = self._remote.fill(following, pinned)  # type: ignore[arg-type]
            return None if sent is None else PendingMask(sent[0], (), sent[1])
        host = self._allocate(following, pinned)
        if host is None:
            self.accept(seq_ids, matchers, tokens)
            return None
        if not self._lowered:
            # The workers need the GIL for a few lines between xgrammar's calls; the caller's commit and planning are
            # pure Python and would hold it for the switch interval (5 ms by default) each time. Until ``wait``.
            _SWITCH.lower()
            self._lowered = True
        pool, bitmask = self._worker(), host.bitmask
        chunks = _chunks(_constrained(seq_ids, matchers, tokens), _numbered(following), self.num_workers or 1)
        return PendingMask(host, tuple(pool.submit(self._advance, acc, fill, bitmask) for acc, fill in chunks))

    def wait(self, pending: PendingMask) -> HostGrammarMask:
        """The filled mask of ``advance`` once the workers are done (re-raising what they raised); forgets the
        matchers whose grammar ended with the accepted tokens."""
        if pending.ticket is not None:
            return self._count_remote(pending.host, pending.ticket, time.perf_counter())
        start = time.perf_counter()
        try:
            ended = [pair for work in pending.work for pair in work.result()]
        finally:
            self._restore_switch_interval()
            self.stats.wait_s += time.perf_counter() - start
            self.stats.num_waits += 1
        for rid, live in ended:
            if self._live.get(rid) is live:
                del self._live[rid]
        return pending.host

    def cancel(self, pending: PendingMask) -> None:
        """``wait`` for a mask that will not be used (its step was dropped): never raises; what the workers raised
        is dropped with the step."""
        if pending.ticket is not None:
            with contextlib.suppress(RuntimeError):
                self.wait(pending)
            return
        if all(work.exception() is None for work in pending.work):
            self.wait(pending)
        self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._lowered:
            _SWITCH.restore()
            self._lowered = False

    def accept(self, seq_ids: Sequence[str], matchers: Sequence[Matcher | None], tokens: Sequence[int]) -> None:
        """Advance each constrained row's matcher by the token sampled for it (the mask allowed it, so the matcher
        accepts it); a matcher whose grammar ended (it accepted a stop id, which ends the request) is forgotten.
        With a grammar process the accepts are queued for it (sent with the next fill)."""
        if self._remote is not None and _remote_rows(matchers):
            rows = [(live, token) for live, token in zip(matchers, tokens, strict=True) if live is not None]
            ended = {id(m) for m in self._remote.accept(rows, self._stop_set)}  # type: ignore[arg-type]
            if ended:
                for rid, live in zip(seq_ids, matchers, strict=True):
                    if id(live) in ended and self._live.get(rid) is live:
                        del self._live[rid]
            return
        for rid, live in self._accept(_constrained(seq_ids, matchers, tokens)):
            if self._live.get(rid) is live:
                del self._live[rid]

    def _count_remote(self, host: HostGrammarMask, ticket: int, waited_from: float) -> HostGrammarMask:
        """The grammar process's fill ``ticket`` into ``host``, once done (its times added to the stats;
        ``waited_from``: when the caller started waiting, 0.0 when it was not a ``wait``)."""
        host, accept_s, fill_s, rows = self._process().result(ticket, host)
        stats = self.stats
        stats.accept_s += accept_s
        stats.fill_s += fill_s
        stats.num_fills += 1
        stats.rows_filled += rows
        if waited_from:
            stats.wait_s += time.perf_counter() - waited_from
            stats.num_waits += 1
        return host

    def _allocate(self, matchers: Sequence[Matcher | None], pinned: bool) -> HostGrammarMask | None:
        """An unfilled buffer for the constrained rows among ``matchers``, None when there is none."""
        positions = [k for k, m in enumerate(matchers) if m is not None]
        if not positions:
            return None
        from fnvllm.executor.sampler import HostGrammarMask  # torch: not at import (the simulator has none)

        return HostGrammarMask.allocate(positions, self.words, pinned)

    def _advance(
        self, accepts: list[tuple[str, Matcher, int]], fills: list[tuple[int, Matcher]], bitmask: torch.Tensor
    ) -> list[tuple[str, Matcher]]:
        """A worker's part of ``advance``; returns the (id, matcher) pairs whose grammar ended."""
        ended = self._accept(accepts)
        self._fill(fills, bitmask)
        return ended

    def _accept(self, rows: list[tuple[str, Matcher, int]]) -> list[tuple[str, Matcher]]:
        """Each (id, matcher, token) row's matcher accepts its token (one xgrammar call); returns the (id, matcher)
        pairs whose grammar ended. A matcher already ended is skipped (a dropped speculative row's token)."""
        rows = [row for row in rows if not row[1].matcher.is_terminated()]
        if not rows:
            return []
        xgr = import_xgrammar()
        start = time.perf_counter()
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([r[1].matcher for r in rows], [r[2] for r in rows])
        self.stats.accept_s += time.perf_counter() - start
        for (_, live, _), ok in zip(rows, accepted, strict=True):
            live.accepted += ok
        return [(rid, live) for rid, live, _ in rows if live.matcher.is_terminated()]

    def _fill(self, rows: list[tuple[int, Matcher]], bitmask: torch.Tensor) -> None:
        """Fill each (bitmask row, matcher) row: a row whose grammar ended allows any token; the others are filled by
        one xgrammar call (several rows: on xgrammar's threads)."""
        filled, indices = [], []
        for row, live in rows:
            if live.matcher.is_terminated():
                bitmask[row] = -1
            else:
                filled.append(live.matcher)
                indices.append(row)
        start = time.perf_counter()
        if len(filled) == 1:
            filled[0].fill_next_token_bitmask(bitmask, indices[0])
        elif filled:
            self._batch(len(filled)).batch_fill_next_token_bitmask(filled, bitmask, indices)
        self.stats.fill_s += time.perf_counter() - start
        self.stats.num_fills += 1
        self.stats.rows_filled += len(filled)

    def _batch(self, num_rows: int) -> Any:
        """The calling thread's xgrammar BatchGrammarMatcher for a fill of ``num_rows`` rows: this worker's share of
        ``num_threads``, but at most one thread per ROWS_PER_FILL_THREAD rows (xgrammar starts its threads at every
        call, ~20-60 us each: a thread for one or two rows costs more than it saves)."""
        share = max(1, self.num_threads // (self.num_workers or 1))
        key = (threading.get_ident(), max(1, min(share, num_rows // ROWS_PER_FILL_THREAD)))
        if key not in self._batches:
            self._batches[key] = import_xgrammar().BatchGrammarMatcher(key[1])
        return self._batches[key]

    def _worker(self) -> ThreadPoolExecutor:
        """The threads that run ``advance`` (``num_workers``), started on first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.num_workers or 1, thread_name_prefix="fnvllm-grammar")
        return self._pool

    def prune(self, live: Container[str]) -> None:
        """Drop the matchers of requests not in ``live`` (they finished by length or a stop string, or were
        aborted). A step already launched keeps the matchers it holds."""
        gone = [rid for rid in self._live if rid not in live]
        if self._remote is not None:
            self._remote.drop(m for rid in gone if isinstance(m := self._live[rid], RemoteMatcher))
        for rid in gone:
            del self._live[rid]

    @property
    def num_live(self) -> int:
        """Matchers held (tests)."""
        return len(self._live)


def _remote_rows(matchers: Sequence[object]) -> bool:
    """Whether ``matchers`` live in the grammar process (one Grammars makes matchers of one kind: the first
    constrained row's says)."""
    return isinstance(next(filter(None, matchers), None), RemoteMatcher)


def _constrained(
    seq_ids: Sequence[str], matchers: Sequence[Matcher | None], tokens: Sequence[int]
) -> list[tuple[str, Matcher, int]]:
    """The (id, matcher, token) of each constrained row."""
    return [(rid, m, t) for rid, m, t in zip(seq_ids, matchers, tokens, strict=True) if m is not None]


def _numbered(matchers: Sequence[Matcher | None]) -> list[tuple[int, Matcher]]:
    """The (bitmask row, matcher) of each constrained row: bitmask rows number the constrained rows in order."""
    return list(enumerate(m for m in matchers if m is not None))


def _chunks(
    accepts: list[tuple[str, Matcher, int]], fills: list[tuple[int, Matcher]], num_chunks: int
) -> list[tuple[list[tuple[str, Matcher, int]], list[tuple[int, Matcher]]]]:
    """Cut the rows to fill into ``num_chunks`` contiguous chunks (fewer when there are fewer rows), each with the
    accepts of its own matchers, so that a matcher accepts its token before its mask is filled in the same chunk;
    the accepts of matchers with no row to fill go to the first chunk."""
    size = -(-len(fills) // num_chunks)  # ceil
    parts = [fills[k : k + size] for k in range(0, len(fills), size)]
    by_matcher = {id(row[1]): row for row in accepts}
    chunks = [([by_matcher.pop(id(m)) for _, m in part if id(m) in by_matcher], part) for part in parts]
    chunks[0][0].extend(by_matcher.values())
    return chunks


class GrammarProcess:
    """The parent's side of a grammar process: a Python process of its own (``python -m
    fnvllm.executor.structured``) that holds the matchers and runs every accept and fill, so that xgrammar's work
    and the engine loop's Python never share a GIL (in one process the grammar thread's work measured as if it ran
    after the loop's, not beside it: docs/structured_outputs.md).

    Messages go over a socket pair, each a pickled tuple: the ops queued since the last message (new matchers,
    dropped ones, accepted tokens), then an optional fill into one of MASK_SLOTS bitmask slots of a shared memory
    file (pinned for the device's copy when ``pinned``). Only a fill is answered, in order: (ticket, error, accept
    seconds, fill seconds, rows filled). Accepts are never waited for: a matcher ends exactly when it accepts a stop
    id, which the parent knows without asking.
    """

    def __init__(self, info_json: str, vocab_size: int, num_threads: int, num_workers: int = 1) -> None:
        self.words = (vocab_size + 31) // 32
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        cmd = [sys.executable, "-m", "fnvllm.executor.structured", str(child.fileno())]
        self._proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), env=env)
        child.close()
        self._conn = Connection(parent.detach())
        self.cores = _CORES.split(self._proc.pid)  # (the loop thread's, the process's), or None: not split
        threads = num_threads if self.cores is None else max(1, min(num_threads, len(self.cores[1])))
        self._conn.send(("init", info_json, vocab_size, threads, num_workers))
        self._ops: list[tuple[Any, ...]] = []
        self._next_mid = 0
        self._tickets = 0  # fills sent
        self._answered = 0  # fills answered
        self._replies: dict[int, tuple[Any, ...]] = {}
        self._capacity = 0  # rows per slot
        self._slots: list[Any] = []  # per slot, its int32 tensor (the current map's)
        self._marks = [False] * MASK_SLOTS  # per slot: its event was recorded after its last upload was queued
        self._events: list[Any] = []  # per slot, that CUDA event (pinned slots only)
        self._next_slot = 0
        self._last_slot: int | None = None
        self._maps: list[tuple[Any, str, bool]] = []  # (tensor, path, pinned) of every map made, freed at close
        self.pin_failed = False  # CUDA would not pin the shared file: masks are copied to pinned buffers instead
        self._copy_pinned: set[int] = set()  # tickets whose mask goes to a pinned buffer (``pin_failed``)
        split = self.cores is not None
        self._finalizer = weakref.finalize(self, _close_process, self._proc, self._conn, self._maps, split)

    def new(self, spec: StructuredOutput) -> RemoteMatcher:
        """A fresh matcher of ``spec`` (compiled there, once per (kind, text))."""
        mid, self._next_mid = self._next_mid, self._next_mid + 1
        self._ops.append(("new", mid, spec.kind, spec.text))
        return RemoteMatcher(mid)

    def drop(self, matchers: Iterable[RemoteMatcher]) -> None:
        """Forget matchers (their requests left)."""
        self._ops.extend(("drop", m.mid) for m in matchers)

    def accept(self, rows: Sequence[tuple[RemoteMatcher, int]], stop_ids: Container[int]) -> list[RemoteMatcher]:
        """Queue each (matcher, token) accept, skipping ended matchers; returns those that end with it (dropped there
        once they have)."""
        ended, mids, tokens = [], [], []
        for live, token in rows:
            if live.ended:
                continue
            mids.append(live.mid)
            tokens.append(token)
            live.accepted += 1
            if token in stop_ids:
                live.ended = True
                ended.append(live)
        if mids:  # one op: the process accepts them with one xgrammar call
            self._ops.append(("accept", mids, tokens))
        # the ended ones end there too: forgotten after their accept (a later fill of one allows any token)
        self._ops.extend(("drop", m.mid) for m in ended)
        return ended

    def fill(self, matchers: Sequence[RemoteMatcher | None], pinned: bool) -> tuple[HostGrammarMask, int] | None:
        """Send the queued ops and a fill of the masks of the constrained rows among ``matchers`` (their positions
        are the batch rows, as for ``Grammars.masks``); returns the mask (filled once ``result`` returns) and its
        ticket, or None (the ops are sent all the same) when none is constrained."""
        positions = [k for k, m in enumerate(matchers) if m is not None]
        if not positions:
            self.flush()
            return None
        host = self._take(len(positions), pinned)
        rows = [matchers[k].mid for k in positions]  # type: ignore[union-attr]
        host.rows.numpy()[:] = positions
        ticket, self._tickets = self._tickets, self._tickets + 1
        if pinned and self.pin_failed:
            self._copy_pinned.add(ticket)
        self._send(("fill", self._last_slot, rows))
        return host, ticket

    def flush(self) -> None:
        """Send the queued ops (nothing is answered)."""
        if self._ops:
            self._send(None)

    def result(self, ticket: int, host: HostGrammarMask) -> tuple[HostGrammarMask, float, float, int]:
        """Wait for fill ``ticket`` into ``host``; the filled mask (``host``, or its copy in a pinned buffer when
        the shared file could not be pinned) and (accept seconds, fill seconds, rows filled) in the grammar process.
        Raises RuntimeError with the grammar process's error, or when it exited."""
        while ticket not in self._replies:
            try:
                while not self._conn.poll(1.0):  # never a hang on a process that died
                    if self._proc.poll() is not None:
                        raise EOFError
                reply = self._conn.recv()
            except (EOFError, OSError) as error:
                raise RuntimeError(f"the grammar process exited (code {self._proc.poll()})") from error
            self._replies[reply[0]] = reply
            self._answered += 1
        _, error, accept_s, fill_s, rows = self._replies.pop(ticket)
        if error is not None:
            raise RuntimeError(f"the grammar process failed: {error}")
        if ticket in self._copy_pinned:
            self._copy_pinned.discard(ticket)
            host = _pinned_copy(host)
        return host, accept_s, fill_s, rows

    def close(self) -> None:
        """Stop the process and free the shared buffers; the calling thread gets back the cores it had before the
        split, if it is the thread that made it. Idempotent."""
        self._finalizer()
        self.cores = None

    def _send(self, fill: tuple[Any, ...] | None) -> None:
        ops, self._ops = self._ops, []
        try:
            self._conn.send_bytes(pickle.dumps((ops, fill), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as error:
            raise RuntimeError(f"the grammar process exited (code {self._proc.poll()})") from error

    def _take(self, num_rows: int, pinned: bool) -> HostGrammarMask:
        """The next slot's buffer for ``num_rows`` rows (a larger map first when they do not fit), once the copy
        that last read that slot has run."""
        import torch

        from fnvllm.executor.sampler import HostGrammarMask

        if num_rows > self._capacity or (pinned and not self._maps[-1][2] and not self.pin_failed):
            self._map(max(num_rows, 2 * self._capacity, 64), pinned)
        if self._last_slot is not None and self._maps[-1][2]:
            if not self._events:
                self._events = [torch.cuda.Event() for _ in range(MASK_SLOTS)]
            self._events[self._last_slot].record()  # behind the upload of the slot taken last (queued by now)
            self._marks[self._last_slot] = True
        slot = self._next_slot
        self._next_slot = (slot + 1) % MASK_SLOTS
        if self._marks[slot]:
            self._events[slot].synchronize()
            self._marks[slot] = False
        self._last_slot = slot
        offset = (num_rows * self.words + 1) // 2 * 2
        return HostGrammarMask(self._slots[slot][: offset + 2 * num_rows], num_rows, self.words)

    def _map(self, capacity: int, pinned: bool) -> None:
        """A new shared file of MASK_SLOTS slots of ``capacity`` rows (pinned for CUDA copies when ``pinned``),
        mapped here and, with the next message, there; the old map stays until close (a copy may read it)."""
        import torch

        slot_words = -(-((capacity * self.words + 1) // 2 * 2 + 2 * capacity) // 1024) * 1024
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="fnvllm-grammar-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.truncate(4 * slot_words * MASK_SLOTS)
        with open(path, "r+b") as f:
            buffer = mmap.mmap(f.fileno(), 4 * slot_words * MASK_SLOTS)
        flat = torch.frombuffer(buffer, dtype=torch.int32)
        if pinned:
            from torch.cuda._pin_memory_utils import pin_memory

            try:
                pin_memory(flat.data_ptr(), flat.numel() * 4)
            except RuntimeError:  # the driver refused (e.g. a pinned-memory limit): copy each mask instead
                pinned, self.pin_failed = False, True
        self._maps.append((flat, path, pinned))
        self._slots = [flat[k * slot_words : (k + 1) * slot_words] for k in range(MASK_SLOTS)]
        self._marks = [False] * MASK_SLOTS
        self._last_slot = None  # the old map's: its buffers stay alive, so its copies need no wait
        self._next_slot = 0
        self._capacity = capacity
        self._ops.append(("map", path, slot_words))


def _pinned_copy(host: HostGrammarMask) -> HostGrammarMask:
    """``host``'s mask and rows in a fresh pinned buffer (torch's caching pinned allocator)."""
    from fnvllm.executor.sampler import HostGrammarMask

    copy = HostGrammarMask.allocate(host.rows.tolist(), host.words, pinned=True)
    copy.bitmask.copy_(host.bitmask)
    return copy


class _CoreSplit:
    """The split of the cores between the engine loop's thread and the grammar processes (SPLIT_CORES): the first
    split saves the thread's cores and keeps its share of them (``_halves``); every grammar process gets the rest.
    Counted, so that the thread gets its cores back when the last process is closed (from that thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: tuple[int, set[int]] | None = None  # (thread ident, its cores before the split)

    def split(self, pid: int) -> tuple[list[int], list[int]] | None:
        """Give process ``pid`` its cores (and the calling thread its own, at the first split); both sets, or None
        when not split (SPLIT_CORES off, fewer than two cores, or affinities that may not change)."""
        if not SPLIT_CORES or not hasattr(os, "sched_getaffinity"):
            return None
        with self._lock:
            mine, theirs = _halves(os.sched_getaffinity(0) if self._saved is None else self._saved[1])
            if not mine or not theirs:
                return None
            try:
                os.sched_setaffinity(pid, theirs)
                if self._saved is None:
                    saved = (threading.get_ident(), os.sched_getaffinity(0))
                    os.sched_setaffinity(0, mine)
                    self._saved = saved
            except OSError:  # not allowed to change affinities: leave them
                return None
            self._users += 1
            return mine, theirs

    def release(self) -> None:
        """One process fewer; after the last, the thread that split gets its cores back (if it is the caller)."""
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._saved is not None:
                if self._saved[0] == threading.get_ident():
                    os.sched_setaffinity(0, self._saved[1])
                self._saved = None


_CORES = _CoreSplit()
# The engine loop's thread keeps 1 / LOOP_CORES_SHARE of the physical cores (at least one); the process, the rest.
LOOP_CORES_SHARE = 4


def _halves(cores: set[int]) -> tuple[list[int], list[int]]:
    """(the loop thread's cores, the grammar process's): whole physical cores (a core's hyperthreads stay together,
    so xgrammar's threads never share a physical core with the loop), 1 / LOOP_CORES_SHARE of them (at least one)
    for the loop; ([], []) with fewer than two physical cores."""
    groups: dict[str, list[int]] = {}
    for cpu in sorted(cores):
        groups.setdefault(_siblings(cpu), []).append(cpu)
    physical = list(groups.values())
    if len(physical) < 2:
        return [], []
    keep = max(1, len(physical) // LOOP_CORES_SHARE)
    return [c for g in physical[:keep] for c in g], [c for g in physical[keep:] for c in g]


def _siblings(cpu: int) -> str:
    """The hyperthreads of ``cpu``'s physical core as Linux lists them (the cpu itself when unknown)."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return str(cpu)


def _close_process(
    proc: subprocess.Popen[bytes], conn: Connection, maps: list[tuple[Any, str, bool]], split: bool
) -> None:
    """Stop a grammar process (it exits at the end of its input), free the shared maps, and give up its share of
    the core split (``split``). Run once: by ``GrammarProcess.close``, when the object is collected, or at exit (a
    killed engine's process sees the end of its input and exits too; the maps' files are unlinked once mapped)."""
    if split:
        _CORES.release()
    conn.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    for flat, path, pinned in maps:
        if pinned:
            from torch.cuda._pin_memory_utils import unpin_memory

            with contextlib.suppress(AssertionError, RuntimeError):  # at exit CUDA may be gone already
                unpin_memory(flat.data_ptr())
        with contextlib.suppress(OSError):
            os.unlink(path)
    maps.clear()


def _serve(fd: int) -> None:
    """The grammar process: apply each message's ops in order, answer each fill (``GrammarProcess``); exit at the
    end of the input. An error is answered with the next fill (the ops after it in that message are skipped)."""
    import signal

    import numpy as np

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; this process ends at its EOF
    conn = Connection(fd)
    _, info_json, vocab_size, num_threads, num_workers = conn.recv()
    pool = ThreadPoolExecutor(num_workers) if num_workers > 1 else None
    xgr = import_xgrammar()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json))
    compiled: dict[tuple[str, str], Any] = {}
    matchers: dict[int, Any] = {}
    batches: dict[Any, Any] = {}
    slots: list[np.ndarray] = []
    words = (vocab_size + 31) // 32
    error: str | None = None
    accept_s, ticket = 0.0, 0
    while True:
        try:
            ops, fill = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            start = time.perf_counter()
            accepts: list[tuple[Any, int]] = []
            for op in ops:
                _flush_accepts(xgr, accepts)  # an earlier step's tokens go first
                if op[0] == "accept":  # a step's tokens (one per matcher): accepted at the next op, or by the fill
                    accepts = [(m, t) for m, t in zip(map(matchers.get, op[1]), op[2], strict=True) if m is not None]
                elif op[0] == "new":
                    key = (op[2], op[3])
                    if key not in compiled:
                        compiled[key] = compiler.compile_grammar(_grammar(xgr, StructuredOutput(*key)))
                    matchers[op[1]] = xgr.GrammarMatcher(compiled[key])
                elif op[0] == "drop":
                    matchers.pop(op[1], None)
                elif op[0] == "map":
                    with open(op[1], "r+b") as f:
                        flat = np.frombuffer(mmap.mmap(f.fileno(), 0), dtype=np.int32)
                    with contextlib.suppress(OSError):  # both processes have it mapped: no file left behind a kill
                        os.unlink(op[1])
                    slots = [flat[k * op[2] : (k + 1) * op[2]] for k in range(len(flat) // op[2])]
            if fill is None or pool is None:
                _flush_accepts(xgr, accepts)
            accept_s += time.perf_counter() - start
        except Exception:  # answered with the next fill
            error = error or traceback.format_exc()
        if fill is None:
            continue
        _, slot, mids = fill
        fill_s, rows = 0.0, 0
        if error is None:
            try:
                start = time.perf_counter()
                rows_of = [matchers.get(m) for m in mids]
                if pool is None:
                    rows = _fill_rows(xgr, batches, num_threads, rows_of, slots[slot], words)
                else:  # each worker accepts the tokens of its chunk's matchers, then fills the chunk
                    chunked = (pool, num_workers, num_threads)
                    rows = _fill_in_chunks(xgr, chunked, batches, accepts, rows_of, slots[slot], words)
                fill_s = time.perf_counter() - start
            except Exception:
                error = traceback.format_exc()
        conn.send((ticket, error, accept_s, fill_s, rows))
        error, accept_s, ticket = None, 0.0, ticket + 1


def _flush_accepts(xgr: Any, accepts: list[tuple[Any, int]]) -> None:
    """Accept the queued (matcher, token) pairs with one xgrammar call (a matcher appears at most once: one token a
    row per step), then empty the queue."""
    if accepts:
        xgr.BatchGrammarMatcher.batch_accept_token([a[0] for a in accepts], [a[1] for a in accepts])
        accepts.clear()


def _fill_in_chunks(
    xgr: Any,
    chunked: tuple[ThreadPoolExecutor, int, int],
    batches: dict[Any, Any],
    accepts: list[tuple[Any, int]],
    matchers: list[Any],
    slot: Any,
    words: int,
) -> int:
    """The grammar process's fill with its worker threads: the rows cut into one contiguous chunk per worker, each
    accepting its matchers' queued tokens, then filling its rows (on num_threads / workers of xgrammar's threads);
    the accepts of matchers not filled go first, here. Returns the rows xgrammar filled."""
    pool, workers, num_threads = chunked
    size = -(-len(matchers) // workers)
    by_matcher = {id(m): (m, t) for m, t in accepts}
    chunks = []
    for begin in range(0, len(matchers), size):
        part = matchers[begin : begin + size]
        chunks.append((begin, part, [by_matcher.pop(id(m)) for m in part if id(m) in by_matcher]))
    _flush_accepts(xgr, list(by_matcher.values()))
    accepts.clear()
    threads = max(1, num_threads // workers)

    def run(begin: int, part: list[Any], mine: list[tuple[Any, int]]) -> int:
        _flush_accepts(xgr, mine)
        return _fill_rows(xgr, batches, threads, part, slot[begin * words :], words, key=begin)

    return sum(pool.map(lambda chunk: run(*chunk), chunks))


def _fill_rows(
    xgr: Any, batches: dict[Any, Any], num_threads: int, matchers: list[Any], slot: Any, words: int, key: int = 0
) -> int:
    """Fill bitmask row k of ``slot`` for matchers[k] (None, a matcher dropped because its grammar ended or its
    request left, allows any token); returns the rows xgrammar filled. ``key``: which worker's BatchGrammarMatchers
    to use (one object fills from one thread)."""
    bitmask = slot[: len(matchers) * words].reshape(len(matchers), words)
    filled, indices = [], []
    for row, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[row] = -1
        else:
            filled.append(matcher)
            indices.append(row)
    if len(filled) == 1:
        filled[0].fill_next_token_bitmask(bitmask, indices[0])
    elif filled:
        threads = max(1, min(num_threads, len(filled) // ROWS_PER_FILL_THREAD))
        if (key, threads) not in batches:
            batches[key, threads] = xgr.BatchGrammarMatcher(threads)
        batches[key, threads].batch_fill_next_token_bitmask(filled, bitmask, indices)
    return len(filled)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
