"""The running sequences as columns: ``RunningRows`` (aligned with ``EngineState.running``) and ``DecodePrefix``.

Both are derived fields of EngineState, kept so that schedule and commit can work column-wise: every
transition that changes ``running`` rebuilds them together with it (see _rows.py for why columns).

Private representation (docs/design.md, "State representation"); ``fnvllm.testing.invariants.check_derived``
compares both with a fresh recomputation from the primary fields after every rule of the state machine.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import attrs

from fnvllm.state._rows import drop_rows, insert_rows
from fnvllm.state._tokens import Chunks, as_chunks
from fnvllm.state.params import SamplingParams
from fnvllm.state.request import Request


@attrs.frozen
class RunningRows:
    """Every per-sequence column of the running sequences, aligned: row i of each describes ``ids[i]``.

    ids: the running request ids (``EngineState.running``).
    num_computed / num_tokens / block_tables / chain_hashes: as the EngineState fields of those names.
    output_chunks / output_tails: each request's generated tokens as chunks + tail (see _tokens.py).
    params / prompt_lens / token_limits: each request's sampling params, prompt length and prompt + max_tokens
        (fixed per request; kept here so a step reads them as columns instead of looking up each request).
    slots: each request's slot (``EngineState.slots``), fixed from admission until it leaves running.
    num_needing_history: rows whose params need the token history (plans attach it only when this is > 0).
    """

    ids: tuple[str, ...] = ()
    num_computed: tuple[int, ...] = ()
    num_tokens: tuple[int, ...] = ()
    output_chunks: tuple[Chunks, ...] = ()
    output_tails: tuple[tuple[int, ...], ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    chain_hashes: tuple[tuple[int, ...], ...] = ()
    params: tuple[SamplingParams, ...] = ()
    prompt_lens: tuple[int, ...] = ()
    token_limits: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    num_needing_history: int = 0

    def with_tables(self, block_tables: tuple[tuple[int, ...], ...]) -> RunningRows:
        """The same rows with new block tables."""
        columns = list(self._columns())
        columns[5] = block_tables
        return _rows_from(columns, self.num_needing_history)

    def with_progress(
        self,
        num_computed: tuple[int, ...],
        num_tokens: tuple[int, ...],
        output_chunks: tuple[Chunks, ...],
        output_tails: tuple[tuple[int, ...], ...],
        chain_hashes: tuple[tuple[int, ...], ...],
    ) -> RunningRows:
        """The same rows after a commit: new computed counts, lengths, outputs and chain hashes."""
        return RunningRows(
            self.ids,
            num_computed,
            num_tokens,
            output_chunks,
            output_tails,
            self.block_tables,
            chain_hashes,
            self.params,
            self.prompt_lens,
            self.token_limits,
            self.slots,
            self.num_needing_history,
        )

    def take(self, n: int) -> RunningRows:
        """The first ``n`` rows (preemption always removes rows from the back)."""
        if n == len(self.ids):
            return self
        dropped = self.params[n:]
        return _rows_from([column[:n] for column in self._columns()], self._history_after(dropped))

    def drop(self, indices: Sequence[int]) -> RunningRows:
        """Without the rows at ``indices`` (ascending)."""
        if not indices:
            return self
        dropped = [self.params[i] for i in indices]
        return _rows_from([drop_rows(column, indices) for column in self._columns()], self._history_after(dropped))

    def insert(self, positions: Sequence[int], new: Sequence[RunningRows]) -> RunningRows:
        """With each one-row ``new[j]`` inserted at ``positions[j]`` (positions count earlier insertions)."""
        if not new:
            return self
        new_rows = zip(*([column[0] for column in row._columns()] for row in new), strict=True)  # by column
        columns = [
            insert_rows(column, positions, values) for column, values in zip(self._columns(), new_rows, strict=True)
        ]
        return _rows_from(columns, self.num_needing_history + sum(row.num_needing_history for row in new))

    @classmethod
    def one(
        cls,
        request: Request,
        num_computed: int,
        num_tokens: int,
        output: tuple[int, ...],
        table: tuple[int, ...],
        chain: tuple[int, ...],
        slot: int,
    ) -> RunningRows:
        """A single row, for an admitted request."""
        params = request.params
        return cls(
            (request.request_id,),
            (num_computed,),
            (num_tokens,),
            (as_chunks(output),),
            ((),),
            (table,),
            (chain,),
            (params,),
            (len(request.prompt),),
            (request.token_limit,),
            (slot,),
            int(params.needs_history),
        )

    def _columns(self) -> tuple[tuple[Any, ...], ...]:
        return (
            self.ids,
            self.num_computed,
            self.num_tokens,
            self.output_chunks,
            self.output_tails,
            self.block_tables,
            self.chain_hashes,
            self.params,
            self.prompt_lens,
            self.token_limits,
            self.slots,
        )

    def _history_after(self, dropped: Sequence[SamplingParams]) -> int:
        if not self.num_needing_history:
            return 0
        return self.num_needing_history - sum(1 for params in dropped if params.needs_history)


def _rows_from(columns: Sequence[tuple[Any, ...]], num_needing_history: int) -> RunningRows:
    """RunningRows from its columns in ``RunningRows._columns`` order."""
    ids, computed, tokens, chunks, tails, tables, chains, params, prompt_lens, limits, slots = columns
    return RunningRows(
        ids, computed, tokens, chunks, tails, tables, chains, params, prompt_lens, limits, slots, num_needing_history
    )


@attrs.frozen
class DecodePrefix:
    """The leading plain decodes of ``running``, which schedule and commit handle column-wise.

    inputs: the input row (last token, as a 1-tuple) of each of the first ``len(inputs)`` running sequences, all
        plain decodes (exactly one token left to compute). Sequences after them may be decodes too.
    block_due: ascending indices of those whose block table is full, so that their next token opens a new block.
    steps_to_limit: a lower bound on the decode steps before one of them reaches its token limit (0: unknown), so
        that commit compares lengths with limits only on the steps where one may stop for length.
    phases: for each of them, ``(num_tokens - s) % compaction_period(block_size)`` where s is the plan step of the
        next commit. A decode's length and the step number both grow by one per step, so the phase is fixed, and
        the rows that reach a compaction point when plan step s commits are those whose phase is ``-s % period``:
        a C-level ``bytes.find`` instead of a modulo over every row.
    """

    inputs: tuple[tuple[int, ...], ...] = ()
    block_due: tuple[int, ...] = ()
    steps_to_limit: int = 0
    phases: bytes = b""

    def take(self, n: int, block_due: tuple[int, ...]) -> DecodePrefix:
        """The first ``n`` rows, with ``block_due`` as given."""
        if n == len(self.inputs) and block_due is self.block_due:
            return self
        return DecodePrefix(self.inputs[:n], block_due, self.steps_to_limit, self.phases[:n])

    def drop(self, indices: Sequence[int]) -> DecodePrefix:
        """Without the running rows at ``indices`` (ascending); rows after them move up."""
        k = len(self.inputs)
        inside = [i for i in indices if i < k]
        if not inside:
            return self
        gone = set(inside)
        due = tuple(i - bisect.bisect_left(inside, i) for i in self.block_due if i not in gone)
        phases = b"".join(self.phases[start + 1 : stop] for start, stop in pairwise([-1, *inside, k]))
        return DecodePrefix(drop_rows(self.inputs, inside), due, self.steps_to_limit, phases)
