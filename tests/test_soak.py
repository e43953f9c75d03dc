"""Soak: 10,000 requests through the pure core with a paged-KV toy executor and a pool small enough for preemption
storms, random aborts (also of rows in a pending plan) and random EOS. Checked against the naive reference model:
every request finishes or is aborted exactly once, no token is lost or duplicated across preemption, and the pool
ends all free with no references.

``FNVLLM_SOAK_REQUESTS=200000 python -m pytest tests/test_soak.py`` runs a longer soak (the default is 10,000).
"""

from __future__ import annotations

import os
import random

from fnvllm.state import CoreConfig, EngineState, SamplingParams, abort, add_request, commit, initial_state, schedule
from fnvllm.state.plan import StepPlan
from fnvllm.testing import invariants as inv
from fnvllm.testing.reference import NaiveModel
from fnvllm.testing.toy import KVToyExecutor

NUM_REQUESTS = int(os.environ.get("FNVLLM_SOAK_REQUESTS", "10000"))
VOCAB = 64
EOS = frozenset({0, 1})
# 48 blocks of 4 tokens hold about 5 requests at their longest, while up to 12 may run: preemption storms.
CONFIG = CoreConfig(
    block_size=4,
    num_blocks=48,
    max_num_batched_tokens=48,
    max_num_seqs=12,
    max_model_len=80,
    eos_token_ids=EOS,
    vocab_size=VOCAB,
)
PREFIXES = [tuple(range(2, 2 + n)) for n in (4, 9, 16)]  # shared prompt starts: prefix-cache hits and evictions


class Soak:
    """The core, the toy executor, the naive model, and a ledger of how each request ended."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state: EngineState = initial_state(CONFIG)
        self.executor = KVToyExecutor(VOCAB)
        self.model = NaiveModel(EOS)
        self.ended: dict[str, str] = {}  # request id -> "stop" / "length" / "abort", set exactly once
        self.num_added = self.num_steps = self.num_preempted = self.num_aborted_planned = 0

    def add_some(self) -> None:
        """Keep about 30 requests live (far more than the pool holds at once)."""
        while self.num_added < NUM_REQUESTS and len(self.model.outputs) < 30 and self.rng.random() < 0.7:
            rid = f"r{self.num_added}"
            self.num_added += 1
            prefix = self.rng.choice([(), *PREFIXES])
            prompt = prefix + tuple(self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 20)))
            params = SamplingParams(
                max_tokens=self.rng.randint(1, CONFIG.max_model_len - len(prompt)),
                ignore_eos=self.rng.random() < 0.5,
                stop_token_ids=(self.rng.randrange(VOCAB),) if self.rng.random() < 0.2 else (),
            )
            self.state = add_request(self.state, rid, prompt, params)
            self.model.add(self.state.requests[rid])

    def abort_some(self, plan: StepPlan | None) -> None:
        """Now and then abort a live request; with a plan pending, often one of its rows."""
        if self.rng.random() >= 0.02 or not self.model.outputs:
            return
        planned = [rid for rid in plan.seq_ids if rid in self.model.outputs] if plan is not None else []
        rid = self.rng.choice(planned if planned and self.rng.random() < 0.5 else sorted(self.model.outputs))
        self.num_aborted_planned += rid in planned
        self.state = abort(self.state, rid)
        self.model.abort(rid, plan is not None)
        self.end(rid, "abort")

    def end(self, rid: str, reason: str) -> None:
        assert rid not in self.ended, f"{rid} ended twice: {self.ended[rid]} then {reason}"
        self.ended[rid] = reason

    def step(self) -> None:
        """Schedule, maybe abort, execute, commit; the output must equal the naive model's."""
        self.abort_some(None)
        self.state, plan = schedule(self.state)
        self.num_preempted += len(plan.preempted)
        self.abort_some(plan)
        sampled = self.executor.execute(plan).token_ids
        self.state, output = commit(self.state, plan, sampled)
        expected = self.model.commit(plan, sampled)
        assert output == expected, f"step {plan.step}: core {output} != model {expected}"
        for record in output.finished:
            self.end(record.request_id, record.reason)
        self.num_steps += 1

    def check_tokens(self) -> None:
        """Every live request holds exactly the model's tokens (none lost or duplicated by preemption)."""
        for rid in self.model.outputs:
            assert inv.seq_tokens(self.state, rid) == self.model.tokens(rid), rid
        inv.check_blocks_conserved(self.state)
        inv.check_ref_counts(self.state)


def test_soak_preemption_storms_aborts_and_eos() -> None:
    """10,000 requests (FNVLLM_SOAK_REQUESTS) end exactly once each, their tokens match the naive model through
    preemption storms and aborts, and the pool returns to all free with zero reference counts."""
    soak = Soak(seed=8)
    max_steps = 200 * NUM_REQUESTS
    while soak.num_added < NUM_REQUESTS or soak.state.has_unfinished:
        soak.add_some()
        soak.step()
        if soak.num_steps % 500 == 0:
            soak.check_tokens()
        assert soak.num_steps < max_steps, "liveness: the soak did not drain"
    soak.check_tokens()
    assert len(soak.ended) == NUM_REQUESTS and not soak.model.outputs
    reasons = list(soak.ended.values())
    assert {"stop", "length", "abort"} <= set(reasons)
    assert soak.num_preempted > NUM_REQUESTS // 10, f"only {soak.num_preempted} preemptions: not a storm"
    assert soak.num_aborted_planned > 0
    pool = soak.state.pool
    assert pool.num_free == CONFIG.num_blocks and not pool.ref_counts
    assert not soak.state.requests and not soak.state.running and not soak.state.waiting
