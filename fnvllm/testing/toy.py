"""Deterministic toy executors that apply StepPlans without a model, for tests and the core benchmark.

``KVToyExecutor`` simulates a paged KV cache: every fed token is written, with its position, into the slot its
block table names; a sampled token is a hash of the context *read back through the block table*. A scheduler
that hands out a wrong block, reuses a cached block with different contents, or forgets a token therefore
changes the outputs, which is what the invariance tests compare.

``CounterToyExecutor`` reads nothing: each sampled token is a hash of (request id, tokens generated so far).
It costs O(1) per sequence, so the core benchmark measures the scheduler, not the toy.
"""

from __future__ import annotations

import zlib

import attrs

from fnvllm.executor.base import ExecuteResult
from fnvllm.state.overlap import feed_sources
from fnvllm.state.plan import StepPlan
from fnvllm.testing.invariants import ShadowKV, write_plan


@attrs.frozen
class ToyLaunch:
    """A toy step that was launched: its plan (with the input tokens it really fed) and its result."""

    plan: StepPlan
    result: ExecuteResult


class KVToyExecutor:
    """A paged-KV simulation. ``vocab_size`` bounds the produced token ids; ``eos`` ids may be produced.

    overlap: also act as an ``OverlapExecutor``. A launch runs at once (the toy has no device to wait for), so
    a speculative step's writes land in the simulated cache before the step it follows is committed, as on a
    GPU; in a step fed by another, each row continuing a sequence that step sampled takes the sampled token as
    its input, never the plan's placeholder (``fnvllm.state.overlap.feed_sources``).
    shadow: also keep ``shadow``, a context-carrying copy of the cache (``fnvllm.testing.invariants.write_plan``)
        that ``invariants.check_kv(state, executor.shadow)`` compares with what the state claims: every computed
        position and every prefix-cache block must hold K/V of exactly the tokens the state says (the stale-KV
        oracle). Costs memory quadratic in the sequence length: for small tests.
    """

    def __init__(self, vocab_size: int = 1000, overlap: bool = False, shadow: bool = False) -> None:
        self.vocab_size = vocab_size
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.shadow: ShadowKV | None = {} if shadow else None
        self.next_step = 0
        self.supports_overlap = overlap

    def launch(self, plan: StepPlan, fed_by: object | None = None) -> ToyLaunch:
        """Run ``plan`` now (fed by ``fed_by``'s sampled tokens when given); ``collect`` returns its result."""
        if fed_by is not None:
            assert isinstance(fed_by, ToyLaunch)
            samples = fed_by.result.token_ids
            inputs = []
            for rid, tokens, source in zip(
                plan.seq_ids, plan.input_tokens, feed_sources(fed_by.plan, plan), strict=True
            ):
                if source is not None:
                    assert len(tokens) == 1, f"{rid} is fed from the device but feeds {len(tokens)} tokens"
                    tokens = (samples[source],)
                inputs.append(tokens)
            plan = attrs.evolve(plan, input_tokens=tuple(inputs))
        return ToyLaunch(plan, self.execute(plan))

    def collect(self, launched: object) -> ExecuteResult:
        """The launched step's tokens."""
        assert isinstance(launched, ToyLaunch)
        return launched.result

    def discard(self, launched: object) -> None:
        """The launched step will not be committed: expect its step number again (its writes stay, as on a GPU)."""
        assert isinstance(launched, ToyLaunch)
        self.next_step = launched.plan.step

    def reset(self, next_step: int) -> None:
        """Forget the simulated cache and expect ``next_step`` next."""
        self.slots.clear()
        if self.shadow is not None:
            self.shadow.clear()
        self.next_step = next_step

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Write the plan's tokens into the simulated cache and return one token per sampling sequence."""
        if plan.step != self.next_step:
            raise RuntimeError(f"toy executor expected step {self.next_step}, got plan.step {plan.step}")
        self.next_step += 1
        if self.shadow is not None:
            write_plan(self.shadow, plan)
        bs = plan.block_size
        for tokens, start, table in zip(plan.input_tokens, plan.start_positions, plan.block_tables, strict=True):
            for offset, token in enumerate(tokens):
                position = start + offset
                self.slots[table[position // bs] * bs + position % bs] = (position, token)
        sampled = []
        for tokens, start, table, sample in zip(
            plan.input_tokens, plan.start_positions, plan.block_tables, plan.sample, strict=True
        ):
            if sample:
                sampled.append(self._next_token(table, start + len(tokens), bs))
        return ExecuteResult(tuple(sampled))

    def _next_token(self, table: tuple[int, ...], context_len: int, bs: int) -> int:
        context = []
        for position in range(context_len):
            stored_position, token = self.slots[table[position // bs] * bs + position % bs]
            if stored_position != position:
                raise RuntimeError(f"slot for position {position} holds position {stored_position}")
            context.append(token)
        return zlib.crc32(repr(context).encode()) % self.vocab_size


class CounterToyExecutor:
    """O(1) per sequence: token = hash(request id, tokens generated so far) % vocab_size."""

    def __init__(self, vocab_size: int = 10000) -> None:
        self.vocab_size = vocab_size

    def reset(self, next_step: int) -> None:
        """Nothing to forget: the tokens do not depend on KV contents."""

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """One token per sampling sequence, independent of the KV contents."""
        return ExecuteResult(
            tuple(
                zlib.crc32(f"{rid}/{n}".encode()) % self.vocab_size
                for rid, n, sample in zip(plan.seq_ids, plan.num_generated, plan.sample, strict=True)
                if sample
            )
        )
