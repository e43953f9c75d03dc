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

Overlapped steps: see ``ModelExecutor.launch`` and docs/structured_outputs.md (a step with a constrained row fed
by the step still in flight samples once that step's tokens are accepted; its forward still overlaps). By default
the collect that brings the tokens accepts them and fills the next masks itself (``accept``, ``masks``); with
``ModelExecutor.sample_deferred_at = "launch"``, ``advance`` runs both on a worker thread while the engine loop
commits and plans (xgrammar does both without holding the GIL). ``Grammars.stats`` says where the time went.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from fnvllm.state.errors import InvalidRequestError
from fnvllm.state.params import SamplingParams, StructuredOutput
from fnvllm.state.plan import StepPlan

if TYPE_CHECKING:  # the loop imports this module, and the simulator runs the loop without torch
    import torch

    from fnvllm.executor.sampler import HostGrammarMask

GIL_SWITCH_S = 1e-4  # the GIL switch interval while the grammar worker runs (``Grammars.advance``)
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
        alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec.text))
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


def default_fill_threads() -> int:
    """Threads for the mask fills: every core this process may use but one (left to the engine loop, which commits
    and plans while the fill runs)."""
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else max(1, os.cpu_count() or 1)


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


class Grammars:
    """Compiled grammars (cached by (kind, text)) and per-request matchers for one tokenizer.

    tokenizer: the Hugging Face tokenizer of the model; vocab_size: the model's (logits') vocabulary size, which
    may exceed the tokenizer's; stop_ids: the engine's EOS ids (the only ids a complete grammar allows).
    tokenizer_info: an xgrammar TokenizerInfo to use instead of the tokenizer's (benchmarks on checkpoints
    without a tokenizer). num_threads: xgrammar's threads for filling several rows' masks (default: every core
    but one, ``default_fill_threads``). num_workers: the grammar worker threads of ``advance``, each accepting
    and filling its own chunk of the rows (with num_threads / num_workers of xgrammar's threads). The compiler is
    built on first use, so an engine whose requests are unconstrained never imports xgrammar.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        tokenizer_info: Any = None,
        num_threads: int | None = None,
        num_workers: int = 1,
    ) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"Grammars.num_threads must be >= 1 (or None: every core but one), got {num_threads}")
        if num_workers < 1:
            raise ValueError(f"Grammars.num_workers must be >= 1, got {num_workers}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.tokenizer_info = tokenizer_info
        self.num_threads = num_threads or default_fill_threads()
        self.num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None  # the grammar worker (``advance``), started on first use
        self._lowered = False  # whether this object holds the GIL switch interval lowered (``advance`` to ``wait``)
        self._compiler: Any = None
        # xgrammar's BatchGrammarMatchers (they fill several rows' masks on threads), one per calling thread (the
        # caller's, the grammar worker's): one object must not fill from two threads at once.
        self._batches: dict[int, Any] = {}
        self._compiled: dict[tuple[str, str], Any] = {}
        self._live: dict[str, Matcher] = {}
        self.stats = GrammarStats()

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
        out: list[Matcher | None] = []
        for i in rows:
            spec = plan.params[i].structured
            if spec is None:
                out.append(None)
                continue
            rid = plan.seq_ids[i]
            live = self._live.get(rid)
            if live is None or (i >= plan.num_continuing and plan.num_generated[i] == 0):
                live = Matcher(import_xgrammar().GrammarMatcher(self._compile(spec)))
                self._live[rid] = live
            out.append(live)
        return tuple(out)

    def masks(self, matchers: Sequence[Matcher | None], pinned: bool = False) -> HostGrammarMask | None:
        """The bitmask of the constrained rows among ``matchers`` (their positions are the batch rows), filled on the
        calling thread; None when none is constrained. Each row allows the tokens its matcher accepts next; a row
        whose grammar already ended (a speculative row of a request that finished in the step before: its token is
        dropped) allows any. pinned: the buffer is bound for a GPU."""
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
        row (the tokens are accepted at once)."""
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
        chunks = _chunks(_constrained(seq_ids, matchers, tokens), _numbered(following), self.num_workers)
        return PendingMask(host, tuple(pool.submit(self._advance, acc, fill, bitmask) for acc, fill in chunks))

    def wait(self, pending: PendingMask) -> HostGrammarMask:
        """The filled mask of ``advance`` once the workers are done (re-raising what they raised); forgets the
        matchers whose grammar ended with the accepted tokens."""
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
        if all(work.exception() is None for work in pending.work):
            self.wait(pending)
        self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._lowered:
            _SWITCH.restore()
            self._lowered = False

    def accept(self, seq_ids: Sequence[str], matchers: Sequence[Matcher | None], tokens: Sequence[int]) -> None:
        """Advance each constrained row's matcher by the token sampled for it (the mask allowed it, so the matcher
        accepts it); a matcher whose grammar ended (it accepted a stop id, which ends the request) is forgotten."""
        for rid, live in self._accept(_constrained(seq_ids, matchers, tokens)):
            if self._live.get(rid) is live:
                del self._live[rid]

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
        share = max(1, self.num_threads // self.num_workers)
        key = (threading.get_ident(), max(1, min(share, num_rows // ROWS_PER_FILL_THREAD)))
        if key not in self._batches:
            self._batches[key] = import_xgrammar().BatchGrammarMatcher(key[1])
        return self._batches[key]

    def _worker(self) -> ThreadPoolExecutor:
        """The threads that run ``advance`` (``num_workers``), started on first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="fnvllm-grammar")
        return self._pool

    def prune(self, live: Container[str]) -> None:
        """Drop the matchers of requests not in ``live`` (they finished by length or a stop string, or were
        aborted). A step already launched keeps the matchers it holds."""
        for rid in [rid for rid in self._live if rid not in live]:
            del self._live[rid]

    @property
    def num_live(self) -> int:
        """Matchers held (tests)."""
        return len(self._live)


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
