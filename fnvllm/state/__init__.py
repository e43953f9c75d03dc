"""The pure core of fnvllm: frozen state, scheduling and commit as pure functions. Imports no torch.

The engine loop, in three lines::

    state, plan = schedule(state)
    tokens = executor.execute(plan).token_ids
    state, output = commit(state, plan, tokens)

One module per box: ``state`` (EngineState, add_request, abort), ``scheduler`` (budget and policy), ``kv`` (the
KV seam: blocks and the prefix cache, which schedule and commit call), ``pool`` (the block pool it manages),
``commit``, ``plan``, ``policy``, ``overlap`` (planning step N+1 before step N's tokens are known:
``speculate`` and ``reconcile``, which ``EngineLoop`` uses on a GPU). The modules whose names start with ``_``
hold the state's internal representation (persistent maps, running columns, chunked outputs); they are private
and may change, and docs/design.md says what each is for and the measurement behind it. Use the names exported
here.
"""

from fnvllm.state.commit import commit, finish
from fnvllm.state.config import CoreConfig
from fnvllm.state.errors import InvalidConfigError, InvalidRequestError, PlanMismatchError
from fnvllm.state.hashing import BlockHasher, chain_hashes, hash_block_xxh3
from fnvllm.state.kv import CachedPrefix, KVManager
from fnvllm.state.params import SamplingParams, StructuredOutput, copies
from fnvllm.state.plan import StepPlan, TokenHistory
from fnvllm.state.policy import FCFS, PRIORITY, Policy, fcfs_key, priority_key
from fnvllm.state.pool import BlockPool, CachedBlock
from fnvllm.state.request import FinishedRequest, FinishReason, Request, SequenceView, StepOutput
from fnvllm.state.scheduler import schedule
from fnvllm.state.state import EngineState, abort, add_request, forget_kv, initial_state, validate_request

__all__ = [
    "FCFS",
    "PRIORITY",
    "BlockHasher",
    "BlockPool",
    "CachedBlock",
    "CachedPrefix",
    "CoreConfig",
    "EngineState",
    "FinishReason",
    "FinishedRequest",
    "InvalidConfigError",
    "InvalidRequestError",
    "KVManager",
    "PlanMismatchError",
    "Policy",
    "Request",
    "SamplingParams",
    "SequenceView",
    "StepOutput",
    "StepPlan",
    "StructuredOutput",
    "TokenHistory",
    "abort",
    "add_request",
    "chain_hashes",
    "commit",
    "copies",
    "fcfs_key",
    "finish",
    "forget_kv",
    "hash_block_xxh3",
    "initial_state",
    "priority_key",
    "schedule",
    "validate_request",
]
