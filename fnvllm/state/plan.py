"""StepPlan: what one step runs, as a frozen record the executor applies without reading the state.

The plan is columnar (parallel tuples, one entry per scheduled sequence, in batch order) because the executor
turns it into flat device arrays anyway, and because building one small object per sequence per step would
dominate the scheduler's cost at hundreds of running sequences.

Worked example (block_size 4): sequence "a" has 6 prompt tokens, none computed, budget 4; "b" is decoding at
position 9 with last sampled token 77:

    seq_ids         = ("b", "a")
    input_tokens    = ((77,), (11, 12, 13, 14))
    start_positions = (9, 0)
    block_tables    = ((3, 8, 2), (5,))
    sample          = (True, False)      # "a" is mid-prefill: nothing to sample yet
"""

from __future__ import annotations

from operator import mul
from typing import Any

import attrs

from fnvllm.state.params import SamplingParams


@attrs.frozen
class TokenHistory:
    """A sequence's prompt and output tokens, sent only to requests whose sampler needs them (penalties)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


@attrs.frozen
class StepPlan:
    """One step's work.

    step: index of this step; the executor checks it is the one it expects next.
    block_size: tokens per KV block (slot of position p is block_tables[i][p // block_size] * bs + p % bs).
    seq_ids: scheduled sequences, in batch order.
    input_tokens: the token ids each sequence feeds this step (a prefill chunk, or its last sampled token).
    start_positions: position of each sequence's first fed token (= its tokens already computed).
    block_tables: each sequence's KV block ids, covering at least start + len(input) tokens.
    sample: whether to sample a token from the sequence's last fed position.
    params: each sequence's sampling parameters.
    num_generated: tokens each sequence had generated before this step (the seed offset of its next sample).
    histories: prompt/output tokens of each admitted row whose params need them (penalties), else None; a
        continuing row's tokens are already where its sampler reads them (the executor's per-slot history).
    preempted: sequences preempted while planning this step (their KV is gone; they recompute later).
    num_admitted: the last ``num_admitted`` rows were admitted from waiting by this step, each starting at its
        prefix-cache hit (its start position); the rows before them were already running. An admitted row is a
        new life of its request id as far as any per-request state kept across steps is concerned: an id can be
        aborted and reused while a step is in flight, so only a row that is not admitted continues the sequence
        that the same id named in the previous step.
    slots: each row's slot (``EngineState.slots``): the index of its per-request state on the device. An admitted
        row's slot may have belonged to a request that left; the executor resets what it keeps there.
    num_steps: decode steps this plan covers (``fnvllm.state.multistep``). Above 1, every row is a decode that
        feeds its one token at sub-step 0 and, at sub-step j, the token it sampled at sub-step j - 1 (fed on the
        device), at position start + j; block tables cover all of them; the executor returns num_steps tokens per
        row, sub-step by sub-step (``substep`` gives each sub-step as a one-step plan). The plan takes the step
        numbers step .. step + num_steps - 1.
    """

    step: int
    block_size: int
    seq_ids: tuple[str, ...] = ()
    input_tokens: tuple[tuple[int, ...], ...] = ()
    start_positions: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    sample: tuple[bool, ...] = ()
    params: tuple[SamplingParams, ...] = ()
    num_generated: tuple[int, ...] = ()
    histories: tuple[TokenHistory | None, ...] = ()
    preempted: tuple[str, ...] = ()
    num_admitted: int = 0
    slots: tuple[int, ...] = ()
    num_steps: int = 1

    @property
    def num_seqs(self) -> int:
        """Number of scheduled sequences."""
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step (each sub-step of a multi-step plan), all sequences together (bounded by
        max_num_batched_tokens)."""
        return sum(len(t) for t in self.input_tokens)

    @property
    def num_samples(self) -> int:
        """Number of tokens the executor must return: one per sequence with sample=True, per sub-step."""
        # C-level identity compares; sum() would add the bools one by one
        return self.sample.count(True) * self.num_steps

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.seq_ids

    @property
    def num_continuing(self) -> int:
        """Rows that were running before this step (the plan's first rows; the admitted ones follow)."""
        return len(self.seq_ids) - self.num_admitted

    def admitted_starts(self) -> dict[str, int]:
        """Each admitted row's start position: the tokens its admission found in the prefix cache (empty, at no
        cost, in the usual step that admits nobody)."""
        if not self.num_admitted:
            return {}
        k = self.num_continuing
        return dict(zip(self.seq_ids[k:], self.start_positions[k:], strict=True))

    def write_blocks(self) -> tuple[tuple[int, ...], ...]:
        """Per sequence, the block ids whose KV slots this step (all its sub-steps) (re)writes."""
        bs, extra = self.block_size, self.num_steps - 1
        return tuple(
            table[start // bs : (start + len(tokens) + extra - 1) // bs + 1]
            for tokens, start, table in zip(self.input_tokens, self.start_positions, self.block_tables, strict=True)
        )


@attrs.frozen
class StepShape:
    """The work of one step, in counts: what a cost model prices (``fnvllm.sim.cost``) and what the GPU timeline
    records per step (``fnvllm.executor.timeline``), computed once, here.

    num_seqs / num_tokens: scheduled sequences and fed tokens. num_decode_seqs: sequences fed exactly one token.
    num_prefill_tokens: tokens of the other sequences. context_tokens: sum over sequences of start position +
    fed tokens (the KV each reads). attn_pairs: (query, key) pairs attention computes, causal. num_samples:
    sequences sampled. graph: whether the step runs as a CUDA graph (decode-only and small enough).
    """

    num_seqs: int
    num_tokens: int
    num_decode_seqs: int
    num_prefill_tokens: int
    context_tokens: int
    attn_pairs: int
    num_samples: int
    graph: bool

    def to_record(self) -> dict[str, Any]:
        """The fields of a timeline record (``FNVLLM_TIMELINE`` format, without timings)."""
        return attrs.asdict(self)


def step_shape(plan: StepPlan, graph_max_seqs: int) -> StepShape:
    """The shape of ``plan``; ``graph`` when every row decodes and at most ``graph_max_seqs`` run. A row of q
    tokens starting at s attends q*s + q*(q+1)/2 (query, key) pairs."""
    lens = list(map(len, plan.input_tokens))
    num_tokens, num_decode = sum(lens), lens.count(1)
    starts = plan.start_positions
    context = sum(starts) + num_tokens
    if num_decode == len(lens):
        pairs = context  # every row is q=1: s + 1 pairs each
    else:  # sum of q*s + q*(q+1)/2, in C-level passes (a Python loop over 256 rows costs more than the rest)
        pairs = sum(map(mul, lens, starts)) + (sum(map(mul, lens, lens)) + num_tokens) // 2
    num_seqs = len(lens)
    is_graph = num_decode == num_seqs and 0 < num_seqs <= graph_max_seqs
    return StepShape(
        num_seqs, num_tokens, num_decode, num_tokens - num_decode, context, pairs, plan.num_samples, is_graph
    )
