"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-probability of every prompt token given its
prefix, and the top-k at each position, computed from the hidden states of the prefill chunks that feed them.

The hidden state at position p predicts token p + 1, so a chunk feeding positions [s, s + L) scores tokens
s + 1 .. s + L - 1 from its own rows; token s is scored from the last row of the previous chunk, whose log-softmax
(V,) is kept on the device per slot (``PromptScorer``) until the next chunk arrives. The final chunk's last row
predicts the first generated token, which is the sampler's business. Worked example, a 7-token prompt in chunks of
4 and 3: step 1 scores tokens 1-3 and keeps row 3's log-softmax; step 2 scores token 4 from it and tokens 5-6 from
its own rows; position 0 is None.

Only a request's first life is scored (no token generated yet, so every fed token is a prompt token); the
scheduler admits such requests without prefix-cache hits, so every prompt position is computed. The LM head runs
over those rows in slices of ``SLICE_ROWS`` so that a long prompt never materialises (L, V) float32 logits at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from fnvllm.executor.base import PromptLogprobs, TokenLogprobs
from fnvllm.state import StepPlan

SLICE_ROWS = 256
"""Positions whose logits are computed at once (256 x a 151,936 vocabulary in float32 is 155 MB)."""

LogitsFn = Callable[[torch.Tensor], torch.Tensor | None]


@attrs.frozen(eq=False)
class ScoredRow:
    """One request's scored prompt positions of a step, on the device until collected.

    seq_id / start: the request and the position of its first entry; leading_none: position ``start`` has no
    score (entries then hold positions start + 1 ...). chosen: (n,) float32 logprob of each scored token; top_ids /
    top_values: (n, k) the top-k at each; tokens: the n scored token ids (host).
    """

    seq_id: str
    start: int
    leading_none: bool
    tokens: tuple[int, ...]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors to copy to the host."""
        return self.chosen, self.top_ids, self.top_values


def prompt_rows(plan: StepPlan) -> tuple[int, ...]:
    """The plan rows whose prompt tokens are scored this step: they asked and have generated nothing yet."""
    if 0 not in plan.num_generated:  # a C-level scan: a step of decodes only pays ~1 us at 256 rows
        return ()
    return tuple(
        i
        for i, (p, n) in enumerate(zip(plan.params, plan.num_generated, strict=True))
        if p.prompt_logprobs is not None and n == 0
    )


class PromptScorer:
    """Scores prompt tokens of the rows that asked, keeping each slot's last chunk row (log-softmax) between
    steps. One per executor; holds at most two (V,) float32 tensors per slot mid-prefill."""

    def __init__(self) -> None:
        # slot -> {position: its (V,) log-softmax}: the row this chunk used and the one it leaves for the next, so
        # that a step that was discarded (``ModelExecutor.discard``) and planned again finds what it used.
        self._carry: dict[int, dict[int, torch.Tensor]] = {}

    def reset(self) -> None:
        """Forget every kept row (the KV cache was emptied)."""
        self._carry.clear()

    def score(self, plan: StepPlan, rows: Sequence[int], hidden: torch.Tensor, logits_of: LogitsFn) -> list[ScoredRow]:
        """Score rows ``rows`` of ``plan`` from ``hidden`` (T, H), every fed token's final hidden state in plan
        order; ``logits_of`` is the LM head (None on a tensor-parallel rank that does not sample: nothing is
        returned there, but it is called alike on every rank, since it gathers the logits from every rank: each
        rank must score the same ``rows``, which ``tp_ranks.worker_plan`` keeps the fields for)."""
        offsets = [0]
        for tokens in plan.input_tokens:
            offsets.append(offsets[-1] + len(tokens))
        scored = []
        for i in rows:
            row = self._score_row(plan, i, hidden[offsets[i] : offsets[i + 1]], logits_of)
            if row is not None:
                scored.append(row)
        return scored

    def _score_row(self, plan: StepPlan, i: int, hidden: torch.Tensor, logits_of: LogitsFn) -> ScoredRow | None:
        """One row: its chunk's hidden states (L, H) -> its ScoredRow (None on a rank without logits)."""
        slot, start, tokens = plan.slots[i], plan.start_positions[i], plan.input_tokens[i]
        k = plan.params[i].prompt_logprobs or 0
        kept = self._carry.pop(slot, {}) if i < plan.num_continuing else {}  # an admitted row is a new life
        carry = kept.get(start - 1)
        if carry is not None:
            self._carry[slot] = {start - 1: carry}
        keep = not plan.sample[i]  # the last row predicts the next prompt token: keep it for the next chunk
        rows = hidden if keep else hidden[:-1]  # (L or L - 1, H)
        parts = [] if carry is None else [carry[None]]
        if rows.shape[0]:
            logprobs = _log_softmax(rows, logits_of)  # (R, V) float32
            if logprobs is None:
                return None
            if keep:
                self._carry.setdefault(slot, {})[start + len(tokens) - 1] = logprobs[-1]
            parts.append(logprobs[:-1] if keep else logprobs)
        first = start if carry is not None else start + 1  # the first scored position
        targets = tokens[first - start :]
        if not targets:  # a one-token chunk with nothing kept before it
            empty = hidden.new_empty((0,), dtype=torch.float32)
            return ScoredRow(plan.seq_ids[i], start, True, (), empty, empty.long().view(0, 0), empty.view(0, 0))
        logprobs = torch.cat(parts)  # (n, V)
        ids = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, ids[:, None]).squeeze(1)  # (n,)
        top = logprobs.topk(k, dim=-1)
        return ScoredRow(plan.seq_ids[i], start, first > start, tuple(targets), chosen, top.indices, top.values)


def _log_softmax(hidden: torch.Tensor, logits_of: LogitsFn) -> torch.Tensor | None:
    """(R, V) float32 log-softmax of the LM head over ``hidden`` (R, H), in slices of SLICE_ROWS rows."""
    parts = []
    for begin in range(0, hidden.shape[0], SLICE_ROWS):
        logits = logits_of(hidden[begin : begin + SLICE_ROWS])
        if logits is None:
            continue
        parts.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(parts) if parts else None


def host_prompt_logprobs(scored: Sequence[ScoredRow], host: Sequence[torch.Tensor]) -> dict[str, PromptLogprobs]:
    """Per request id, its PromptLogprobs, from the ScoredRows and their tensors copied to the host (in order)."""
    out = {}
    for n, row in enumerate(scored):
        chosen, top_ids, top_values = (t.tolist() for t in host[3 * n : 3 * n + 3])
        entries: list[TokenLogprobs | None] = [None] if row.leading_none else []
        for token, value, ids, values in zip(row.tokens, chosen, top_ids, top_values, strict=True):
            entries.append(TokenLogprobs(token, value, tuple(zip(ids, values, strict=True))))
        out[row.seq_id] = PromptLogprobs(row.start, tuple(entries))
    return out
