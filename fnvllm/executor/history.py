"""Each request's tokens on the device, kept per slot, so that penalties read them where the sampler runs.

Repetition, presence and frequency penalties need a row's prompt and output tokens. Sending them with every plan
costs the host O(batch x history) per step (tens of ms at 256 rows) and keeps the step from being planned before
the previous one's tokens are known (overlap). Instead the pure state gives every running request a slot
(``EngineState.slots``), the plan carries a row's history once, when it is admitted (``StepPlan.histories``), and
the executor keeps a (num_slots, max_model_len) int32 buffer of token ids on the device:

    admission:       tokens[slot, 0:n]   = prompt + outputs so far          (host -> device, once per admission)
    after sampling:  tokens[slot, ctx]   = the token just sampled           (device -> device, every step)

where ``ctx = start + fed tokens`` is the row's context length, so ``tokens[slot, 0:ctx]`` is always its whole
sequence when it samples. Every write is keyed by (slot, position): a speculative step that is dropped wrote only
positions its replacement writes again, or that no reader reaches before they are rewritten (a row reads
``[0, ctx)`` and its next sample lands at ``ctx``), so overlapped and plain stepping read the same tokens.

Penalties are then applied by ``fnvllm.kernels.penalties`` to the penalised rows only (P of the S sampled rows):
one program per row reads its tokens ``[0, ctx)`` from the buffer and edits its float32 logits at the tokens it
has seen (no pass over the vocabulary; a per-row int32 count scratch, zero between launches, holds its output
counts while it runs):

    repetition (HF), on every token seen in prompt or output:   logit = logit / r if logit > 0 else logit * r
    presence / frequency (OpenAI), on output tokens:            logit -= frequency * count + presence * (count > 0)

(When no penalised row has a presence or frequency penalty, ``SlotPenalties.counted`` says so and the sampler takes
the faster route of ``penalize_from_``: several short programs per row, no counts; ``fused_sampling``.)

On a GPU the buffer (42 MB at 256 slots of 40,960 tokens) and the count scratch (78 MB: 128 rows of a
151,936-token vocabulary) are allocated when the executor starts, before the KV cache is sized, so that a first
penalised request allocates nothing mid-run; on the CPU the buffer comes with the first penalised request. Steps
without a penalised row do no work here.

The host's part of a penalised decode step is small: the penalised rows' selection (which rows, their slots and
penalty factors on the device, ``PenalisedRows``) is kept while the plan's params object, its sampled rows and
slots stay the same (decode steps without joins or leaves); each step builds its (slot, context length, outputs,
flat index slot * max_len + ctx) columns with numpy, and puts them on the device by one add to the last step's
columns when every row moved by the same amounts (a decode step: one more token, one more output; on a GPU, where
an upload costs more than a launch), else by one upload; ``record`` writes the sampled tokens at the flat indices
(``put_``) those columns hold.

Worked example: rows in slots (3, 0), contexts (10, 7), outputs (4, 2), max_len 16: columns (3, 0 | 10, 7 | 4, 2 |
58, 7), uploaded; the next decode step's contexts (11, 8) and outputs (5, 3) moved by 1 and 1, so its columns are
the last ones + (0 | 1 | 1 | 1) on the device (on a GPU), and ``record`` puts the two sampled tokens at flat 59 and 8.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from fnvllm.executor.device_inputs import upload
from fnvllm.executor.penalties import TokenView
from fnvllm.executor.threads import host_memory_bytes
from fnvllm.kernels.sampling_ref import penalize_ref
from fnvllm.state.errors import InvalidConfigError
from fnvllm.state.plan import StepPlan

SCRATCH_ROWS = 128  # rows of the penalty kernel's count scratch (its programs; more rows are taken in turn)


@attrs.frozen(eq=False)
class SlotPenalties:
    """One step's penalties of the P penalised rows (in sampling order), read from the slot buffer on the device.

    tokens: the (num_slots, max_len) int32 buffer. meta: (3, P) int64 slot, context length, outputs per row.
    factors: (3, P) float32 repetition, frequency, presence. counts: the (G, V) int32 zero scratch of the kernel,
    one row per program (None off CUDA: the reference runs there). counted: some row has a frequency or presence
    penalty (False: repetition alone everywhere, so the edits need no output counts; True when unknown).
    """

    tokens: torch.Tensor
    meta: torch.Tensor
    factors: torch.Tensor
    counts: torch.Tensor | None
    counted: bool = True

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on the (P, V) float32 logits of the penalised rows: repetition, then presence / frequency."""
        return penalize(logits, self.tokens, self.meta, self.factors, self.counts)

    def token_view(self) -> TokenView:
        """The slot buffer and this step's columns: what bad words of several ids are matched against."""
        return TokenView(self.tokens, self.meta)


def penalize(
    work: torch.Tensor, tokens: torch.Tensor, meta: torch.Tensor, factors: torch.Tensor, counts: torch.Tensor | None
) -> torch.Tensor:
    """``fnvllm.kernels.penalties.penalize_`` on CUDA (``counts``: its zero scratch), ``penalize_ref`` elsewhere
    (imported lazily: Triton may be missing from a CPU install)."""
    if work.device.type == "cuda" and counts is not None:
        from fnvllm.kernels.penalties import penalize_

        return penalize_(work, tokens, meta, factors, counts)
    return penalize_ref(work, tokens, meta, factors)


@attrs.frozen(eq=False)
class PenalisedRows:
    """What the penalised rows of a step depend on apart from its tokens: which of the sampled rows they are, their
    slots and penalty factors. Kept by ``SlotHistory`` while the rows do not change (a decode step without joins or
    leaves), so a step uploads only its (slot, context length, outputs) columns.

    rows: (P,) int64 plan rows. positions: (P,) int64 their places among the sampled rows. slots: (P,) int64.
    every: the penalised rows are every sampled row, in order (positions is 0..P-1). whole: they are every plan
    row, in order (rows is 0..B-1). factors: (3, P) float32 repetition, frequency, presence on the device.
    counted: some row has a frequency or presence penalty.
    """

    rows: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    every: bool
    whole: bool
    factors: torch.Tensor
    counted: bool
    _positions_on: list[torch.Tensor] = attrs.field(factory=list)

    @classmethod
    def build(cls, plan: StepPlan, rows: Sequence[int], device: torch.device) -> PenalisedRows | None:
        """The penalised rows among ``rows`` (plan rows, sampling order), None when none has a penalty."""
        picked = [(k, i) for k, i in enumerate(rows) if plan.params[i].needs_history]
        if not picked:
            return None
        params = [plan.params[i] for _, i in picked]
        reals = np.array(
            [
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            dtype=np.float32,
        )
        at = np.array([[i for _, i in picked], [k for k, _ in picked]], dtype=np.int64).reshape(2, len(picked))
        every = len(picked) == len(rows)
        whole = len(picked) == len(plan.params) and bool((at[0] == np.arange(len(picked))).all())
        slots = np.array([plan.slots[i] for _, i in picked], dtype=np.int64)
        counted = bool(reals[1:].any())
        return cls(at[0], at[1], slots, every, whole, upload(reals, device), counted)

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """``positions`` on the device (uploaded on first use, then kept)."""
        if not self._positions_on:
            self._positions_on.append(upload(self.positions, device))
        return self._positions_on[0]


@attrs.frozen(eq=False)
class _KeptRows:
    """``SlotHistory``'s last selection and what it was built for: the plan's params object, rows and slots."""

    params: Sequence[object]
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    picked: PenalisedRows | None

    def matches(self, plan: StepPlan, rows: Sequence[int]) -> bool:
        """True when ``plan`` and ``rows`` select the same penalised rows: the very params object (the core hands
        decode steps the same tuple while no request joins or leaves), equal rows and equal slots."""
        return plan.params is self.params and tuple(rows) == self.rows and plan.slots == self.slots


@attrs.frozen(eq=False)
class _StepColumns:
    """One step's penalty columns, kept for ``record`` of the same step and the next step's ``penalties``.

    plan, rows, picked: what they were built for (``rows``: the very object ``penalties`` was given). ctx,
    generated: (P,) int64 on the host. meta: (4, P) int64 on the device: slot, context length, outputs, and the
    flat index slot * max_len + ctx of the row's next token. fits: every row's ctx is below max_len (its next
    token has a place in the buffer).
    """

    plan: StepPlan
    rows: Sequence[int]
    picked: PenalisedRows
    ctx: np.ndarray
    generated: np.ndarray
    meta: torch.Tensor
    fits: bool


def _uniform_step(now: np.ndarray, before: np.ndarray) -> int | None:
    """The one amount every entry of ``now`` moved by since ``before`` (None when they moved by different ones)."""
    moved = now - before
    first = int(moved[0])
    return first if bool((moved == first).all()) else None


def _step_columns(plan: StepPlan, picked: PenalisedRows) -> tuple[np.ndarray, np.ndarray]:
    """(P,) int64 context lengths (start + fed tokens) and generated counts of the penalised rows, this step.
    When every row feeds as many tokens (a decode step: one), that count is added as a scalar (a C-level set of
    the lengths costs half of an array of them)."""
    n = len(plan.start_positions)
    starts = np.fromiter(plan.start_positions, dtype=np.int64, count=n)
    lengths = set(map(len, plan.input_tokens))
    fed = lengths.pop() if len(lengths) == 1 else np.fromiter(map(len, plan.input_tokens), dtype=np.int64, count=n)
    generated = np.fromiter(plan.num_generated, dtype=np.int64, count=n)
    if picked.whole:
        return starts + fed, generated
    return (starts + fed)[picked.rows], generated[picked.rows]


def _check_fits_host(num_bytes: int) -> None:
    """InvalidConfigError naming max_num_seqs and max_model_len when the token buffer (num_bytes) exceeds the host's
    memory (on the CPU it is allocated at the first penalised request, where it would fail mid-run)."""
    memory = host_memory_bytes()
    if num_bytes > memory:
        raise InvalidConfigError(
            f"EngineConfig.max_num_seqs x max_model_len: the per-request token buffer of penalties would take "
            f"{num_bytes / 2**30:.1f} GiB (int32 for every slot's whole context), more than the host's "
            f"{memory / 2**30:.1f} GiB; lower max_num_seqs or max_model_len"
        )


class SlotHistory:
    """The per-slot token buffer of one executor (see the module docstring).

    num_slots: the core's max_num_seqs (slots are in [0, num_slots)). max_len: the core's max_model_len.
    """

    def __init__(self, num_slots: int, max_len: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.max_len, self.vocab_size, self.device = num_slots, max_len, vocab_size, device
        self.tokens: torch.Tensor | None = None  # (num_slots, max_len) int32
        self.counts: torch.Tensor | None = None  # (min(num_slots, SCRATCH_ROWS), vocab_size) int32 zeros
        self.in_use = False  # a penalised request was admitted: sampled tokens must be recorded
        self._kept: _KeptRows | None = None  # the last rows' penalised selection (``_picked``)
        self._step: _StepColumns | None = None  # the last ``penalties``' columns
        self._advances: dict[tuple[int, int], torch.Tensor] = {}  # (4, 1) device steps of meta, by (ctx, outputs)
        # Move kept columns on the device instead of uploading them: on a GPU an upload (pinned staging, a copy)
        # cost the host ~70 us under cProfile on the H200, an add one launch; on the CPU an upload is a view.
        self.advance = device.type == "cuda"
        if device.type == "cpu":  # made at the first penalised request: refuse one that could never be made now
            _check_fits_host(num_slots * max_len * 4)
        if device.type == "cuda":  # before the KV cache is sized, so that it counts them; and no compile mid-run
            self._buffer()
            self.counts = torch.zeros(min(num_slots, SCRATCH_ROWS), vocab_size, dtype=torch.int32, device=device)
            self._compile()

    def _compile(self) -> None:
        """Run the penalty kernel, the copy kernel and the route's edit kernels (``penalize_from_``'s with
        REPETITION_FROM_SOURCE, ``penalised_rows`` with PENALISED_COPY_FUSED; bf16 logits) once on a one-row batch,
        so that they compile now, not in the first penalised step (a stall of seconds mid-run); the shapes that
        specialise them (vocabulary, row strides) are the real ones."""
        assert self.tokens is not None and self.counts is not None  # allocated just before
        work = torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device)
        meta = torch.tensor([[0], [2], [1]], dtype=torch.int64, device=self.device)
        factors = torch.tensor([[1.1], [0.5], [0.5]], dtype=torch.float32, device=self.device)
        penalize(work, self.tokens, meta, factors, self.counts)
        from fnvllm.executor import fused_sampling
        from fnvllm.kernels.penalties import float_rows, penalised_rows, penalize_from_

        logits = torch.zeros(1, self.vocab_size, dtype=torch.bfloat16, device=self.device)
        for rows in (None, torch.zeros(1, dtype=torch.int32, device=self.device)):  # every row, or some rows
            work = float_rows(logits, rows)
            if fused_sampling.REPETITION_FROM_SOURCE or fused_sampling.PENALTIES_FROM_SOURCE:
                penalize_from_(work, logits, rows, self.tokens, meta, factors, self.counts, None)
            if fused_sampling.PENALISED_COPY_FUSED:
                penalised_rows(logits, rows, self.tokens, meta, factors)

    def admit(self, plan: StepPlan) -> None:
        """Write the history of every admitted row that carries one (penalised rows) into its slot."""
        if not plan.num_admitted:
            return
        first = plan.num_continuing
        admitted = [(plan.slots[i], h) for i, h in enumerate(plan.histories[first:], first) if h is not None]
        if not admitted:
            return
        tokens = self._buffer()
        self.in_use = True
        slots = np.repeat([s for s, _ in admitted], [len(h.prompt) + len(h.output) for _, h in admitted])
        positions = np.concatenate([np.arange(len(h.prompt) + len(h.output)) for _, h in admitted])
        ids = np.concatenate([np.asarray(h.prompt + h.output, dtype=np.int64) for _, h in admitted])
        packed = upload(np.stack([slots.astype(np.int64), positions, ids]), self.device)  # (3, N): one copy
        tokens.index_put_((packed[0], packed[1]), packed[2].to(torch.int32))

    def penalties(self, plan: StepPlan, rows: Sequence[int]) -> SlotPenalties | None:
        """The penalties of the sampled ``rows`` (plan rows, in sampling order) that have one, in that
        order (the sampler's penalised rows); None when none has. Reads each one's tokens ``[0, ctx)``."""
        picked = self._picked(plan, rows)
        if picked is None:
            return None
        tokens = self._buffer()
        ctx, generated = _step_columns(plan, picked)
        meta = self._advanced(picked, ctx, generated)
        if meta is None:  # new rows, or rows that moved unevenly: the step's one copy
            meta = upload(np.stack([picked.slots, ctx, generated, picked.slots * self.max_len + ctx]), self.device)
        fits = bool(ctx.max() < self.max_len)
        self._step = _StepColumns(plan, rows, picked, ctx, generated, meta, fits)
        return SlotPenalties(tokens, meta[:3], picked.factors, self.counts, picked.counted)

    def _advanced(self, picked: PenalisedRows, ctx: np.ndarray, generated: np.ndarray) -> torch.Tensor | None:
        """The last step's (4, P) meta moved on the device by the amounts every row's context and output count
        moved since (one device op in place of an upload; the same tensor when nothing moved), when the rows are
        the last step's and each column moved by one amount (a decode step: 1 and 1); else None."""
        last = self._step
        if last is None or last.picked is not picked or not self.advance:
            return None
        moved_ctx, moved_out = _uniform_step(ctx, last.ctx), _uniform_step(generated, last.generated)
        if moved_ctx is None or moved_out is None:
            return None
        if moved_ctx == moved_out == 0:
            return last.meta
        key = (moved_ctx, moved_out)
        step = self._advances.get(key)
        if step is None:
            if len(self._advances) > 8:
                self._advances.clear()
            step = self._advances[key] = upload(np.array([[0], [moved_ctx], [moved_out], [moved_ctx]]), self.device)
        return last.meta + step

    def record(self, plan: StepPlan, rows: Sequence[int], sampled: torch.Tensor) -> None:
        """Write each penalised row's new token (``sampled``: (S,) ids of ``rows``, on the device) at its
        context length, where its next step reads it. After ``penalties`` of the same plan and rows, its upload
        of the (slot, context length) columns is reused (no copy here unless a row has reached max_len)."""
        if self.tokens is None or not self.in_use:
            return  # no penalised request was ever admitted
        step = self._step
        if step is not None and step.plan is plan and step.rows is rows:  # right after this step's ``penalties``
            picked = step.picked
        else:
            picked = self._picked(plan, rows)
            if picked is None:
                return
            step = self._step
        if step is not None and step.plan is plan and step.picked is picked:
            if step.fits:  # the flat indices ``penalties`` put on the device
                values = sampled if picked.every else sampled.index_select(0, picked.positions_on(self.device))
                self.tokens.put_(step.meta[3], values.to(torch.int32))
                return
            ctx = step.ctx
        else:
            ctx = _step_columns(plan, picked)[0]
        keep = ctx < self.max_len  # a row at max_model_len has finished: nothing reads past it
        at = np.stack([picked.positions, picked.slots, ctx])[:, keep]  # (3, P')
        if not at.shape[1]:
            return
        on = upload(at, self.device)
        self.tokens.index_put_((on[1], on[2]), sampled.index_select(0, on[0]).to(torch.int32))

    def _picked(self, plan: StepPlan, rows: Sequence[int]) -> PenalisedRows | None:
        """The penalised rows among ``rows`` (``PenalisedRows``), kept while the plan's params object, the rows
        and the slots are the last call's (a decode step without joins or leaves); None when none has a penalty."""
        kept = self._kept
        if kept is not None and kept.matches(plan, rows):
            return kept.picked
        picked = PenalisedRows.build(plan, rows, self.device)
        self._kept = _KeptRows(plan.params, tuple(rows), plan.slots, picked)
        self._step = None
        return picked

    def _buffer(self) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = torch.zeros(self.num_slots, self.max_len, dtype=torch.int32, device=self.device)
        return self.tokens
