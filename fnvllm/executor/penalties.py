"""Repetition, presence and frequency penalties, as sparse (row, token) edits of the logits.

Penalties touch only the tokens a sequence has seen, so they are sent as index lists, never as dense (B, V)
masks (256 rows of a 152k vocabulary would be 155 MB of counts to zero and fill every step):

    repetition (HF RepetitionPenaltyLogitsProcessor), on each distinct prompt-or-output token of the row:
        logit = logit / penalty if logit > 0 else logit * penalty
    presence / frequency (OpenAI), on each distinct output token, after repetition:
        logit -= frequency * count + presence

The host builds the index lists with numpy (`prepare_penalties`); the device applies them with one gather and
two index_put (`apply_penalties`). Out-of-vocabulary ids are rejected on the host: on CUDA they would be a
device-side assert that kills the process instead of an exception.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np
import torch

from fnvllm.executor.device_inputs import upload
from fnvllm.state.errors import InvalidRequestError
from fnvllm.state.params import SamplingParams
from fnvllm.state.plan import TokenHistory


@attrs.frozen(eq=False)
class TokenView:
    """The tokens of the P rows that keep a history (``SamplingParams.needs_history``), in batch order, as the
    sampler's bad-word matching reads them (``sampler.apply_bad_words``): row p's sequence so far is
    ``tokens[meta[0, p], 0:meta[1, p]]``, whose last ``meta[2, p]`` tokens are generated.

    tokens: (S, L) int32 on the device. meta: (3, P) int64 slot (a row of ``tokens``), context length, generated
    count. Example: rows with prompt (5, 6) and output (7,), and prompt (8,) and no output -> tokens ((5, 6, 7),
    (8, 0, 0)), meta ((0, 1), (3, 1), (1, 0)).
    """

    tokens: torch.Tensor
    meta: torch.Tensor


def token_view(histories: Sequence[TokenHistory], device: torch.device) -> TokenView:
    """The TokenView of ``histories`` (one per row, in batch order): one (P, longest) int32 block, one copy."""
    lengths = [len(h.prompt) + len(h.output) for h in histories]
    tokens = np.zeros((len(histories), max(lengths, default=0) + 1), dtype=np.int32)
    for p, h in enumerate(histories):
        tokens[p, : lengths[p]] = h.prompt + h.output
    meta = np.array([range(len(histories)), lengths, [len(h.output) for h in histories]], dtype=np.int64)
    return TokenView(upload(tokens, device), upload(meta.reshape(3, len(histories)), device))


class Penalties(Protocol):
    """One step's penalties of the penalised rows (P of them, in batch order), however built: from the plan's
    token histories (``PenaltyBatch``) or from the executor's per-slot token buffer
    (``fnvllm.executor.history.SlotPenalties``)."""

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on the (P, V) float32 logits of the penalised rows; returns them."""
        ...

    def token_view(self) -> TokenView | None:
        """The rows' tokens for bad-word matching (None when not kept: no row has a bad word of several ids)."""
        ...


@attrs.frozen(eq=False)
class PenaltyBatch:
    """One step's penalties as (row, token) pairs on the device; row indexes the batch.

    repetition: (B,) float32 per-row repetition penalty (1 = off).
    seen_rows / seen_ids: (N,) int64 each prompt and output token of rows whose repetition penalty is not 1
        (a token may repeat: it is rewritten with the same value).
    output_rows / output_ids: (M,) int64 distinct output tokens of rows with a presence or frequency penalty.
    output_penalty: (M,) float32 frequency * count + presence, subtracted from those logits.
    view: the rows' tokens when some row has a bad word of several ids (``TokenView``), else None.
    """

    repetition: torch.Tensor
    seen_rows: torch.Tensor
    seen_ids: torch.Tensor
    output_rows: torch.Tensor
    output_ids: torch.Tensor
    output_penalty: torch.Tensor
    view: TokenView | None = None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """``apply_penalties_(logits, self)``."""
        return apply_penalties_(logits, self)

    def token_view(self) -> TokenView | None:
        """``view``."""
        return self.view


def _pairs(rows: list[int], token_lists: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) int64 arrays (N,) with rows[i] repeated for each token of token_lists[i]; ids checked."""
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row = int(row_of[bad.argmax()])
        raise InvalidRequestError(f"histories[{row}] token ids must be in [0, {vocab_size})")
    return row_of, ids


def _output_penalties(
    params: Sequence[SamplingParams], rows: list[int], outputs: Sequence[Sequence[int]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (row, token) output pairs and their frequency * count + presence."""
    row_of, ids = _pairs(rows, outputs, vocab_size)
    keys, counts = np.unique(row_of * vocab_size + ids, return_counts=True)  # one entry per distinct pair
    uniq_rows = keys // vocab_size
    frequency = np.zeros(len(params), dtype=np.float64)
    presence = np.zeros(len(params), dtype=np.float64)
    frequency[rows] = [params[i].frequency_penalty for i in rows]
    presence[rows] = [params[i].presence_penalty for i in rows]
    return uniq_rows, keys % vocab_size, frequency[uniq_rows] * counts + presence[uniq_rows]


def prepare_penalties(
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    vocab_size: int,
    device: torch.device,
) -> PenaltyBatch | None:
    """The batch's penalties on `device`, or None when no row has one.

    Raises ValueError when a penalised row has no history, InvalidRequestError on an out-of-vocabulary id.
    """
    penalised = [i for i, p in enumerate(params) if p.needs_history]
    if not penalised:
        return None
    missing = [i for i in penalised if histories[i] is None]
    if missing:
        raise ValueError(f"histories[{missing[0]}] is required: its SamplingParams has a penalty")
    hist = {i: h for i in penalised if (h := histories[i]) is not None}
    rep_rows = [i for i in penalised if params[i].repetition_penalty != 1.0]
    seen = _pairs(rep_rows * 2, [hist[i].prompt for i in rep_rows] + [hist[i].output for i in rep_rows], vocab_size)
    add_rows = [i for i in penalised if params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0]
    out_rows, out_ids, out_penalty = _output_penalties(params, add_rows, [hist[i].output for i in add_rows], vocab_size)
    index = upload(np.stack(seen), device)  # (2, N)
    out_index = upload(np.stack([out_rows, out_ids]), device)  # (2, M)
    repetition = [p.repetition_penalty for p in params]
    matched = any(len(word) > 1 for i in penalised for word in params[i].bad_words_token_ids)
    return PenaltyBatch(
        repetition=upload(np.asarray(repetition, dtype=np.float32), device),
        seen_rows=index[0],
        seen_ids=index[1],
        output_rows=out_index[0],
        output_ids=out_index[1],
        output_penalty=upload(out_penalty.astype(np.float32), device),
        view=token_view([hist[i] for i in penalised], device) if matched else None,
    )


def apply_penalties(logits: torch.Tensor, penalties: PenaltyBatch) -> torch.Tensor:
    """Logits (B, V) with repetition, then presence / frequency penalties; a new tensor, input untouched."""
    return apply_penalties_(logits.clone(), penalties)


def apply_penalties_(logits: torch.Tensor, penalties: PenaltyBatch) -> torch.Tensor:
    """In place: repetition, then presence / frequency penalties on logits (B, V); returns ``logits``."""
    seen = (penalties.seen_rows, penalties.seen_ids)
    values = logits[seen]  # (N,)
    rep = penalties.repetition[penalties.seen_rows]  # (N,)
    logits.index_put_(seen, torch.where(values > 0, values / rep, values * rep))
    return logits.index_put_((penalties.output_rows, penalties.output_ids), -penalties.output_penalty, accumulate=True)
