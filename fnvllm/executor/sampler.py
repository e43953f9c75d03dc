"""One sampling path for every row: penalties, temperature, top-k / top-p / min-p, seeds and logprobs, per row.

The host builds a `SamplingBatch` once per step (`prepare_sampling`: one pass over the rows, one host->device
copy, plus the penalty lists when a row has one); `Sampler.sample` never reads a tensor back to the host. No
option of one row changes how another row is sampled, and a row pays only for the options it uses:

    penalised rows:  copied to float32 (only those rows), penalised there at the tokens each has seen (one
                     launch of `fnvllm.kernels.penalties` reading the executor's slot buffer, or sparse torch
                     edits from host histories, `penalties.py`), sampled from the copy; the other rows are
                     sampled from the logits as they are;
    every row:       one read of its logits at full parallelism, one uniform, 1/C of a re-read
                     (`fnvllm.kernels.sampling.sample_rows`); greedy rows (temperature 0 or top_k 1) take the
                     argmax found by the same read;
    filtered rows:   top-k / min-p rows: one threshold per row found by a program that streams only that row
                     (`fnvllm.kernels.sampling_filters.filtered_pick`: a top-k row compacts its tokens at or
                     above its k-th largest chunk maximum and sorts them in registers), then a draw from the kept
                     tokens; top-p rows without a top-k: sorted on the device;
    logprob rows:    log sum exp of the raw logits and the top-n candidates from one launch over every chunk
                     of those rows (torch.topk then sorts only the n chunks that hold the n best).

Rows with a ``logit_bias`` (``SamplingBatch.logit_bias``): their biases are added to a copy of the logits by one
sparse scatter-add over (row, token) pairs, before everything below; a batch without one is untouched. A row short
of its ``min_tokens`` takes the same path: MASKED_LOGIT is added at its stop-capable ids (the EOS ids the caller
names and its ``stop_token_ids``), so none of them can be drawn before the request may end. A one-id bad word
(``bad_words_token_ids``) is such a ban at every step.

Rows with bad words of several ids (``SamplingBatch.bad_words``) keep a history (``needs_history``), so the step's
tokens are on the device (the executor's slot buffer, ``fnvllm.executor.history``; or the histories given): after
the bias, each word's last id is set to MASKED_LOGIT where the row's output ends with the rest of the word, by a
few batched torch ops that read nothing back to the host (``apply_bad_words``).

Rows with ``allowed_token_ids`` (``SamplingBatch.allowed``): after the bias, every other id of those rows is set to
MASKED_LOGIT on a copy of the logits (their allowed logits gathered, scattered into a MASKED_LOGIT-filled (R, V)
block, which is copied over those R rows); a batch without one is untouched.

Grammar-constrained rows (``SamplingBatch.grammar_mask``, from ``fnvllm.executor.structured``): their disallowed
tokens are set to MASKED_LOGIT (one kernel, ``fnvllm.kernels.grammar_mask``) on a copy of the logits, or on the
logits themselves when the executor marks them scratch and no row asks for logprobs; the other rows are untouched.

Order of operations on a row: logit bias (and one-id bad words), bad words of several ids, allowed token ids,
grammar mask (constrained rows), repetition penalty (HF style, prompt and output tokens), then presence / frequency
(OpenAI style, output tokens); divide by temperature; keep the top-k, then the nucleus top-p of what is left, and
drop tokens below min_p * max probability; invert the CDF of the kept probabilities at the row's uniform.

Randomness. A seeded row's uniform for its n-th generated token is a pure function of (seed, n)
(`seeded_noise.seeded_uniforms`), so its token depends only on its own logits and settings: not on its batch
mates, its row, the device kind or earlier steps. Unseeded rows draw Philox uniforms keyed by (the sampler's seed
and call count, row) on the GPU, and from a torch.Generator on the CPU.

Backends. On a CUDA device with Triton the kernels run; elsewhere (the CPU executor) their torch references do
the same computation (float64 sums), so both give the same tokens for the same uniforms up to rounding at a CDF
step or a filter's threshold.

Logprobs are the log_softmax of the *raw* model logits (before penalties, temperature and filtering), as in
vLLM's default "raw_logprobs" mode: what the model believed, not what the sampler was allowed to pick.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from fnvllm.executor.device_inputs import upload
from fnvllm.executor.fused_sampling import sample_with_kernels, sample_with_references
from fnvllm.executor.penalties import Penalties, TokenView, prepare_penalties
from fnvllm.executor.seeded_noise import seeded_uniforms
from fnvllm.kernels.sampling_ref import log_partition_ref
from fnvllm.state.params import GREEDY_TEMPERATURE, SamplingParams
from fnvllm.state.plan import TokenHistory

if TYPE_CHECKING:  # the kernels module needs Triton, which the CPU build of torch may lack
    from fnvllm.kernels.sampling import SamplingScratch


@attrs.frozen(eq=False)
class RowGroup:
    """Rows sampled from one source: the logits as they are, or the float32 penalised copy of some rows.

    rows: (R,) int32 batch rows, or None for every row. filtered / filtered_sources / filtered_programs: (F,) int32
    batch rows of the group with top-k / top-p / min-p, their row in the group's source tensor, and their place in
    ``rows`` (whose chunk summaries the filter kernel reads).
    """

    rows: torch.Tensor | None
    filtered: torch.Tensor
    filtered_sources: torch.Tensor
    filtered_programs: torch.Tensor


@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling settings of one step as device tensors (B rows).

    scale: (B,) float32 inverse temperature, 0 for greedy rows. top_k: (B,) int32, 0 = off. top_p / min_p: (B,)
    float32, 1 / 0 = off (greedy rows carry the neutral values). uniforms: (B,) float32, a seeded row's uniform;
    fixed: (B,) int32, 1 on those rows. plain / penalised: the rows sampled from the logits and from the penalised
    copy (None when empty); penalties: the penalised rows' edits, numbered by position in ``penalised.rows``.
    logprob_rows: (L,) int32 rows that asked for logprobs, in batch order; max_logprobs: most any of them asked.
    bad_words: the bad words of several ids (``BadWords``, matched each step against the rows' tokens that
    ``penalties.token_view()`` gives), or None.
    candidates: when every filtered row has a top-k, how many of each row's best tokens can hold its kept set
    (the largest top-k plus a margin for ties at the k-th logit); None when some filtered row has none.
    min_p_only: no filtered row has a top-k or a top-p (the filter kernel's fast case; see
    ``fused_sampling.sample_with_kernels``).
    """

    scale: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniforms: torch.Tensor
    fixed: torch.Tensor
    plain: RowGroup | None
    penalised: RowGroup | None
    penalties: Penalties | None
    logprob_rows: torch.Tensor | None
    max_logprobs: int | None
    vocab_size: int
    num_rows: int
    candidates: int | None = None
    min_p_only: bool = False
    grammar_mask: GrammarMask | None = None
    logit_bias: LogitBias | None = None
    allowed: AllowedTokens | None = None
    bad_words: BadWords | None = None


@attrs.frozen(eq=False)
class LogitBias:
    """The ``logit_bias`` of the rows that have one, as N sparse (row, token, bias) entries on the device.

    rows / tokens: (N,) int64 batch rows and token ids. values: (N,) float32 biases. Built from the params'
    pairs (``prepare_logit_bias``): never a dense (B, V) host tensor.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor


def prepare_logit_bias(
    params: Sequence[SamplingParams],
    device: torch.device,
    rows: Sequence[int] | None = None,
    banned: Sequence[int] = (),
    eos_token_ids: frozenset[int] = frozenset(),
) -> LogitBias | None:
    """The batch's LogitBias (one host -> device copy), or None when no row has a bias or a ban. ``rows``: the rows
    that have a bias or bad words, when the caller knows them (else every row is looked at); each one-id bad word
    gets MASKED_LOGIT added. ``banned``: rows short of their min_tokens, whose ``eos_token_ids`` and own
    stop_token_ids get MASKED_LOGIT added. Entries of one (row, token) are summed into one, at least MASKED_LOGIT.
    """
    rows = range(len(params)) if rows is None else rows
    entries = [(i, token, bias) for i in rows for token, bias in params[i].logit_bias or ()]
    words = [(i, word[0], MASKED_LOGIT) for i in rows for word in params[i].bad_words_token_ids if len(word) == 1]
    entries += words
    for i in banned:
        entries += [(i, token, MASKED_LOGIT) for token in sorted(eos_token_ids.union(params[i].stop_token_ids))]
    if not entries:
        return None
    flat = np.array(entries, dtype=np.float64).T  # (3, N): ids are < 2**53 (a vocabulary), exact in float64
    pairs, values = flat[:2].astype(np.int64), flat[2]
    # Each source alone is one entry per (row, token) (a bias is a dict, a ban a set); only words, or a ban on a
    # biased row, can repeat one, and then its entries are summed: a bias and a ban of one id add up.
    if words or (banned and any(params[i].logit_bias for i in banned)):
        keys = pairs[0] * (int(pairs[1].max()) + 1) + pairs[1]
        unique, first = np.unique(keys, return_index=True)
        if len(unique) < len(keys):
            values = np.maximum(np.bincount(np.searchsorted(unique, keys), weights=values), MASKED_LOGIT)
            pairs = pairs[:, first]
    ids = upload(pairs, device)  # (2, N)
    return LogitBias(ids[0], ids[1], upload(values.astype(np.float32), device))


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """A copy of ``logits`` (B, V) with each bias added at its (row, token), in float32 and then rounded to the
    logits' dtype with a floor at its lowest finite value (MASKED_LOGIT is below float16's range: a ban stays
    finite there); ``logits`` itself is not modified. The pairs are distinct (``prepare_logit_bias``), so one
    put writes them all."""
    where = (bias.rows, bias.tokens)
    added = (logits[where].float() + bias.values).clamp_(min=torch.finfo(logits.dtype).min)
    return logits.index_put(where, added.to(logits.dtype))


@attrs.frozen(eq=False)
class BadWords:
    """The bad words of several ids (``SamplingParams.bad_words_token_ids``) of the batch, as N entries on the
    device; each bans its last id at its row when the row's output ends with the rest (its prefix). One-id bad
    words are not here: they are bans of the logit bias (``prepare_logit_bias``).

    positions: (N,) int64 the entry's row among the rows that keep a history (its ``TokenView`` column).
    lengths: (N,) int64 prefix lengths (>= 1). prefixes: (N, M) int64 the prefixes, left-aligned, zero-padded to the
    longest (M). pairs: (N,) int64 the entry's (row, banned id) pair among the U distinct ones, whose batch rows
    and ids are ``rows`` / ``banned`` ((U,) int64): two words ending in the same id at one row ban it once.
    Built from the params alone (``prepare_bad_words``), so the reuse memo may keep it; each step's matching reads
    that step's tokens (``apply_bad_words``).
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    prefixes: torch.Tensor
    pairs: torch.Tensor
    rows: torch.Tensor
    banned: torch.Tensor


def prepare_bad_words(
    params: Sequence[SamplingParams], kept_rows: Sequence[int], device: torch.device
) -> BadWords | None:
    """The BadWords of ``params``' rows (``kept_rows``: the rows that keep a history, in batch order), None when no
    row has a bad word of several ids; one host -> device copy. Example: kept rows (1, 4), row 4 banning (7, 8, 9)
    and (3, 9) -> positions (1, 1), lengths (2, 1), prefixes ((7, 8), (3, 0)), pairs (0, 0), rows (4,), banned (9,).
    """
    words = [(p, row, word) for p, row in enumerate(kept_rows) for word in params[row].bad_words_token_ids]
    words = [(p, row, word) for p, row, word in words if len(word) > 1]
    if not words:
        return None
    longest = max(len(word) for *_, word in words) - 1
    prefixes = np.zeros((len(words), longest), dtype=np.int64)
    pair_of: dict[tuple[int, int], int] = {}
    pairs = []
    for n, (_, row, word) in enumerate(words):
        prefixes[n, : len(word) - 1] = word[:-1]
        pairs.append(pair_of.setdefault((row, word[-1]), len(pair_of)))
    unique = np.array(list(pair_of), dtype=np.int64).reshape(len(pair_of), 2).T  # (2, U)
    columns = np.array([[p for p, *_ in words], [len(word) - 1 for *_, word in words], pairs], dtype=np.int64)
    flat = upload(np.concatenate([columns.ravel(), unique.ravel(), prefixes.ravel()]), device)  # one copy
    num, num_pairs = len(words), len(pair_of)
    head, tail = flat[: 3 * num].view(3, num), flat[3 * num : 3 * num + 2 * num_pairs].view(2, num_pairs)
    return BadWords(head[0], head[1], flat[3 * num + 2 * num_pairs :].view(num, longest), head[2], tail[0], tail[1])


def apply_bad_words(logits: torch.Tensor, bad: BadWords, view: TokenView, copy: bool = True) -> torch.Tensor:
    """``logits`` (B, V) with each bad word's last id at MASKED_LOGIT (or the dtype's lowest finite value, when
    that is higher) at the rows whose output ends with its prefix, read from ``view`` (this step's tokens of the
    rows that keep a history); nothing leaves the device. A copy, unless ``copy`` is False (then ``logits`` itself,
    edited in place: the caller's own copy).

    Entry n at its row's sequence ``tokens[slot, 0:ctx]`` (``generated`` of them output) matches when
    ``generated >= lengths[n]`` and ``tokens[slot, ctx - lengths[n] + j] == prefixes[n, j]`` for every j below
    ``lengths[n]``: prefix (7, 8) matches an output ending (..., 7, 8), not one of a single token 8."""
    out = logits.clone() if copy else logits
    slot, ctx, generated = (view.meta[k].index_select(0, bad.positions) for k in range(3))
    j = torch.arange(bad.prefixes.shape[1], device=logits.device)
    inside = j.unsqueeze(0) < bad.lengths.unsqueeze(1)  # (N, M): the prefix's own places
    at = (ctx - bad.lengths).unsqueeze(1) + j  # (N, M) where each prefix id would sit in the sequence
    seen = view.tokens[slot.unsqueeze(1), at.clamp(0, view.tokens.shape[1] - 1)].to(torch.int64)
    match = ((seen == bad.prefixes) | ~inside).all(dim=1) & (generated >= bad.lengths)  # (N,)
    hit = torch.zeros(bad.rows.shape[0], dtype=torch.int64, device=logits.device)
    hit.scatter_reduce_(0, bad.pairs, match.to(torch.int64), reduce="amax")  # any of a pair's words matched
    value = torch.tensor(max(MASKED_LOGIT, torch.finfo(logits.dtype).min), dtype=logits.dtype, device=logits.device)
    where = (bad.rows, bad.banned)
    return out.index_put_(where, torch.where(hit.bool(), value, out[where]))


@attrs.frozen(eq=False)
class AllowedTokens:
    """The ``allowed_token_ids`` of the R rows that have some, as N sparse (row, token) entries on the device.

    rows: (R,) int64 those batch rows. positions / tokens: (N,) int64 each entry's place in ``rows`` and its token
    id; batch_rows: (N,) int64 its batch row (``rows[positions]``). Built from the params' ids
    (``prepare_allowed``), one host -> device copy; it depends on the params alone (the reuse memo may keep it).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    batch_rows: torch.Tensor


def prepare_allowed(params: Sequence[SamplingParams], rows: Sequence[int], device: torch.device) -> AllowedTokens:
    """The AllowedTokens of ``rows`` (those of ``params`` with allowed_token_ids): one host -> device copy.
    Example: rows (2, 5) allowing (7, 9) and (3,) -> positions (0, 0, 1), tokens (7, 9, 3), batch rows (2, 2, 5)."""
    lists = [params[i].allowed_token_ids or () for i in rows]
    positions = np.repeat(np.arange(len(rows)), [len(ids) for ids in lists])
    flat = np.concatenate([np.asarray(rows), positions, np.concatenate(lists), np.asarray(rows)[positions]])
    on = upload(flat.astype(np.int64), device)  # (R + 3N,)
    num_rows, num = len(rows), len(positions)
    entries = on[num_rows:].view(3, num)
    return AllowedTokens(on[:num_rows], entries[0], entries[1], entries[2])


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens, copy: bool = True) -> torch.Tensor:
    """``logits`` (B, V) with every id of ``allowed.rows`` outside its allowed ids at MASKED_LOGIT (or the dtype's
    lowest finite value, when that is higher); the other rows are untouched. A copy, unless ``copy`` is False
    (then ``logits`` itself, edited in place: the caller's own copy)."""
    out = logits.clone() if copy else logits
    value = max(MASKED_LOGIT, torch.finfo(logits.dtype).min)
    block = logits.new_full((allowed.rows.shape[0], logits.shape[1]), value)  # (R, V)
    block[allowed.positions, allowed.tokens] = logits[allowed.batch_rows, allowed.tokens]
    return out.index_copy_(0, allowed.rows, block)


@attrs.frozen(eq=False)
class HostGrammarMask:
    """The grammar-constrained rows' bitmask on the host, laid out for one copy to the device.

    flat: one int32 buffer (pinned when bound for a GPU): the (R, W) bitmask, then (after padding to an even
    offset) the R batch rows as int64. ``bitmask`` and ``rows`` are views of it, so the matchers fill the bitmask
    in place and ``upload`` sends both with one non-blocking copy.
    """

    flat: torch.Tensor
    num_rows: int
    words: int

    @classmethod
    def allocate(cls, rows: Sequence[int], words: int, pinned: bool) -> HostGrammarMask:
        """A buffer for ``rows`` (batch rows) and ``words`` int32 words per row; the bitmask is left unfilled.
        pinned: take it from torch's caching pinned allocator (which keeps it alive until its copy has run)."""
        offset = _rows_offset(len(rows), words)
        flat = torch.empty(offset + 2 * len(rows), dtype=torch.int32, pin_memory=pinned)
        flat[offset:].view(torch.int64).numpy()[:] = rows
        return cls(flat, len(rows), words)

    @property
    def bitmask(self) -> torch.Tensor:
        """(R, W) int32 view, filled by the matchers."""
        return self.flat[: self.num_rows * self.words].view(self.num_rows, self.words)

    @property
    def rows(self) -> torch.Tensor:
        """(R,) int64 view: the batch row of each bitmask row."""
        return self.flat[_rows_offset(self.num_rows, self.words) :].view(torch.int64)

    def upload(self, device: torch.device | str, scratch: bool = False) -> GrammarMask:
        """The GrammarMask on ``device`` (``scratch``: see GrammarMask): one copy, which does not wait for the device
        when the buffer is pinned."""
        flat = self.flat.to(device, non_blocking=True)
        bitmask = flat[: self.num_rows * self.words].view(self.num_rows, self.words)
        return GrammarMask(bitmask, flat[_rows_offset(self.num_rows, self.words) :].view(torch.int64), scratch)


def _rows_offset(num_rows: int, words: int) -> int:
    """Where the int64 rows start in a HostGrammarMask's int32 buffer (even, so the int64 view is aligned)."""
    return (num_rows * words + 1) // 2 * 2


@attrs.frozen(eq=False)
class GrammarMask:
    """The allowed tokens of the grammar-constrained rows (``fnvllm.executor.structured``), on the device.

    bitmask: (R, ceil(V / 32)) int32, bit t % 32 of word t // 32 set when token t is allowed (xgrammar's layout).
    rows: (R,) int64 batch rows it applies to. The other rows are not touched.
    scratch: the logits are the caller's scratch (it reads them no more after sampling), so the sampler may mask
    them in place instead of on a copy; ignored when a row asks for logprobs (those are of the raw logits).
    """

    bitmask: torch.Tensor
    rows: torch.Tensor
    scratch: bool = False

    @classmethod
    def upload(cls, bitmask: torch.Tensor, rows: Sequence[int], device: torch.device | str) -> GrammarMask:
        """Copy a host bitmask (R, W) and its R batch rows to ``device`` (one non-blocking copy through pinned
        memory on a GPU: it never waits for the work queued on the device)."""
        device = torch.device(device)
        host = HostGrammarMask.allocate(rows, bitmask.shape[1], pinned=device.type == "cuda")
        host.bitmask.copy_(bitmask)
        return host.upload(device)


# What a masked-out logit becomes: far below any real logit yet finite (the sampler flags non-finite logits as a
# broken model), and still finite after dividing by the smallest temperature (GREEDY_TEMPERATURE) in float32.
MASKED_LOGIT = -1e30


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask, kernels: bool = False) -> torch.Tensor:
    """``logits`` (B, V) with every disallowed token of the constrained rows at MASKED_LOGIT (or the dtype's lowest
    finite value, when that is higher); the other rows are untouched. A copy, unless ``mask.scratch`` (then
    ``logits`` itself, masked in place). kernels: one Triton launch (``fnvllm.kernels.grammar_mask``) that writes
    only the masked positions; else its torch reference."""
    out = logits if mask.scratch else logits.clone()
    value = max(MASKED_LOGIT, torch.finfo(logits.dtype).min)
    if kernels:
        from fnvllm.kernels.grammar_mask import mask_rows  # Triton: only where the kernels run

        mask_rows(out, mask.bitmask, mask.rows, value)
    else:
        from fnvllm.kernels.grammar_mask import mask_rows_ref

        mask_rows_ref(out, mask.bitmask, mask.rows, value)
    return out


@attrs.frozen(eq=False)
class Logprobs:
    """Log-probabilities (log_softmax of the raw logits) of the L rows that asked, in batch order.

    top_logprobs / top_ids: (L, n) float32 / int64, n = the batch's max_logprobs, best first; a row that asked
    for fewer keeps the first ones it asked for.
    sampled_logprobs: (L,) float32 log-probability of the token that was sampled.
    packed: a uint8 tensor the other three are views of (the kernels' path: one copy to the host brings them all,
    ``host_views`` splits it there), or None (three tensors of their own).
    """

    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    packed: torch.Tensor | None = None

    def copied(self) -> tuple[torch.Tensor, ...]:
        """The tensors to copy to the host: ``packed`` alone when set, else the three."""
        if self.packed is not None:
            return (self.packed,)
        return (self.top_logprobs, self.top_ids, self.sampled_logprobs)

    def host_views(self, copies: Sequence[torch.Tensor]) -> Logprobs:
        """These logprobs over their host copies (``copied()``'s tensors, in order): with ``packed``, views of its
        copy at the three tensors' byte offsets."""
        if self.packed is None:
            top_logprobs, top_ids, sampled_logprobs = copies
            return Logprobs(top_logprobs, top_ids, sampled_logprobs)
        (buffer,) = copies
        base = self.packed.data_ptr()
        views = []
        for t in (self.top_logprobs, self.top_ids, self.sampled_logprobs):
            at = t.data_ptr() - base
            views.append(buffer[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        return Logprobs(*views, packed=buffer)


@attrs.frozen(eq=False)
class SamplerOutput:
    """packed: (2, B) int64 on the logits' device, token ids then a 0/1 non-finite flag per row (one copy to the
    host brings both). token_ids / non_finite: views of it (a token is meaningless where non_finite is set: the
    row's penalised logits held a NaN or an infinity, which the executor reports instead of returning a token).
    logprobs: present when any row asked for logprobs."""

    packed: torch.Tensor
    logprobs: Logprobs | None

    @property
    def token_ids(self) -> torch.Tensor:
        """(B,) int64 sampled token ids."""
        return self.packed[0]

    @property
    def non_finite(self) -> torch.Tensor:
        """(B,) bool rows whose logits held a NaN or an infinity."""
        return self.packed[1].bool()


def _check_lengths(params: Sequence[object], num_generated: Sequence[int], histories: Sequence[object]) -> None:
    """Raise ValueError unless the per-row sequences have one entry per row and counts are >= 0."""
    if not len(params) == len(num_generated) == len(histories):
        raise ValueError(
            f"params, num_generated and histories must have one entry per row, got lengths "
            f"{len(params)}, {len(num_generated)}, {len(histories)}"
        )
    if any(n < 0 for n in num_generated):
        raise ValueError(f"num_generated must be >= 0 for every row, got {list(num_generated)}")


_LOGPROBS = attrgetter("logprobs")  # each row's SamplingParams.logprobs, in one C-level map


@attrs.define
class _Rows:
    """Per-row host values gathered in one pass (this runs every step for every row: no per-row calls)."""

    scale: list[float]
    top_p: list[float]
    min_p: list[float]
    top_k: list[int]
    filtered: list[int] = attrs.Factory(list)
    seeded: list[int] = attrs.Factory(list)
    penalised: list[int] = attrs.Factory(list)
    logprobs: list[int] = attrs.Factory(list)
    biased: list[int] = attrs.Factory(list)
    banned: list[int] = attrs.Factory(list)  # short of their min_tokens: their stop-capable ids are masked
    allowed: list[int] = attrs.Factory(list)  # with allowed_token_ids: every other id is masked
    max_logprobs: int | None = None


def _gather(params: Sequence[SamplingParams], vocab_size: int, num_generated: Sequence[int] | None = None) -> _Rows:
    """Settings of each row; greedy rows (temperature below GREEDY_TEMPERATURE or top_k 1) keep neutral values
    (scale 0, filters off) and never filter or use a seed. ``num_generated`` (None: every row's is unknown, and
    a row with a min_tokens counts as banned): the rows' generated counts, which say who is still banned."""
    num_rows = len(params)
    rows = _Rows([0.0] * num_rows, [1.0] * num_rows, [0.0] * num_rows, [0] * num_rows)
    _gather_logprobs(rows, params)
    for i, p in enumerate(params):
        if p.needs_history:
            rows.penalised.append(i)
        if p.logit_bias or p.bad_words_token_ids:
            rows.biased.append(i)
        if p.allowed_token_ids:
            rows.allowed.append(i)
        if p.min_tokens and (num_generated is None or num_generated[i] < p.min_tokens):
            rows.banned.append(i)
        if p.temperature < GREEDY_TEMPERATURE or p.top_k == 1:
            continue
        rows.scale[i], rows.top_p[i], rows.min_p[i] = 1.0 / p.temperature, p.top_p, p.min_p
        if p.top_k is not None and p.top_k < vocab_size:
            rows.top_k[i] = p.top_k
        if rows.top_k[i] or p.top_p < 1.0 or p.min_p > 0.0:
            rows.filtered.append(i)
        if p.seed is not None:
            rows.seeded.append(i)
    return rows


def _gather_logprobs(rows: _Rows, params: Sequence[SamplingParams]) -> None:
    """``rows.logprobs`` and ``rows.max_logprobs`` in C-level passes (every row asking is the common case: at 256
    rows a per-row append and max in ``_gather``'s loop doubled its time)."""
    counts = list(map(_LOGPROBS, params))
    num_none = counts.count(None)
    if num_none == len(counts):
        return
    if num_none == 0:
        rows.logprobs, rows.max_logprobs = list(range(len(counts))), max(counts)
        return
    rows.logprobs = [i for i, n in enumerate(counts) if n is not None]
    rows.max_logprobs = max(counts[i] for i in rows.logprobs)


def _group_lists(rows: _Rows, num_rows: int) -> list[list[int]]:
    """[filtered rows] when no row is penalised, else [plain rows, their filtered rows, those rows' positions among
    the plain rows, penalised rows, their filtered rows, those rows' positions among the penalised rows]."""
    if not rows.penalised:
        return [rows.filtered]
    is_penalised = [False] * num_rows
    for i in rows.penalised:
        is_penalised[i] = True
    plain = [i for i in range(num_rows) if not is_penalised[i]]
    position = {row: k for group in (plain, rows.penalised) for k, row in enumerate(group)}
    plain_filtered = [i for i in rows.filtered if not is_penalised[i]]
    pen_filtered = [i for i in rows.filtered if is_penalised[i]]
    return [
        plain,
        plain_filtered,
        [position[i] for i in plain_filtered],
        rows.penalised,
        pen_filtered,
        [position[i] for i in pen_filtered],
    ]


def _make_groups(lists: list[torch.Tensor], num_rows: int, num_penalised: int) -> tuple[RowGroup | None, ...]:
    """(plain, penalised) RowGroups from the device views of ``_group_lists``."""
    if len(lists) == 1:
        return RowGroup(None, lists[0], lists[0], lists[0]), None
    plain_rows, plain_filtered, plain_programs, pen_rows, pen_filtered, pen_programs = lists
    plain = RowGroup(plain_rows, plain_filtered, plain_filtered, plain_programs) if num_penalised < num_rows else None
    penalised = RowGroup(None if num_penalised == num_rows else pen_rows, pen_filtered, pen_programs, pen_programs)
    return plain, penalised


_ALIGN = 4  # int32 elements per 16 bytes: Triton specialises a kernel on whether each pointer is 16-byte aligned


def _upload(rows: _Rows, uniforms: np.ndarray, lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One host -> device copy of everything: [scale, top_p, min_p, uniforms ((B,) float32 each); top_k, fixed
    ((B,) int32 each); the logprob rows; each list] as views of one int32 buffer (few torch calls: this runs
    every step). Each view starts at a multiple of 16 bytes, so a batch size never selects another
    compiled variant of a kernel (a compile stalls a step for a second or more)."""
    num_rows = len(rows.scale)
    fixed = [0] * num_rows
    for i in rows.seeded:
        fixed[i] = 1
    floats = np.array([rows.scale, rows.top_p, rows.min_p, uniforms], dtype=np.float32).view(np.int32)  # (4, B)
    parts = [*floats, rows.top_k, fixed, rows.logprobs, *lists]
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes])
    flat = np.zeros(int(starts[-1]), dtype=np.int32)
    for part, at, n in zip(parts, starts, sizes, strict=False):
        flat[at : at + n] = part
    on = upload(flat, device)
    views = [on[at : at + n] for at, n in zip(starts, sizes, strict=False)]
    return [v.view(torch.float32) for v in views[:4]] + views[4:]


class SamplingMemo:
    """The last SamplingBatch that depended on its rows' params alone, or on them and the step's penalties (no
    seeded row: its uniform reads the step's count; no row short of its min_tokens: its ban ends at a count), and
    the params sequence it was built for. While no request joins or leaves, the core hands each decode step the
    same params tuple (the running columns'), so ``prepare_sampling`` given that same object returns the kept
    batch: no per-row pass, no upload (its device tensors are only read by the sampler). A kept batch with
    penalised rows (``penalised``: their batch rows) is returned with this step's penalties in place of the kept
    ones (``attrs.evolve``: only the penalties read the step's tokens). Why: prepare_sampling was 0.41 ms of the
    host's 3.3 ms per decode step at 256 rows on the H200 (``benchmarks/host_step.py``), spent on the same values
    every step; penalised batches were rebuilt every step (issue 19: 0.6-1.7 ms more host time per step than
    temperature alone)."""

    def __init__(self) -> None:
        self.params: Sequence[SamplingParams] | None = None
        self.key: tuple[int, torch.device] | None = None
        self.batch: SamplingBatch | None = None
        self.penalised: list[int] = []

    def get(self, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> SamplingBatch | None:
        """The kept batch when ``params`` is the very sequence it was built for (same vocabulary and device); its
        ``penalties`` are the step it was built in's (``prepare_sampling`` replaces them)."""
        if params is self.params and self.key == (vocab_size, device):
            return self.batch
        return None

    def keep(
        self,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device,
        batch: SamplingBatch | None,
        penalised: Sequence[int] = (),
    ) -> None:
        """Remember ``batch`` for ``params`` (or forget the last one when ``batch`` is None: not reusable);
        ``penalised``: its penalised batch rows (their penalties are rebuilt at each reuse)."""
        self.params, self.key, self.batch = (
            (None, None, None) if batch is None else (params, (vocab_size, device), batch)
        )
        self.penalised = [] if batch is None else list(penalised)


def _step_penalties(
    params: Sequence[SamplingParams],
    penalised: list[int],
    histories: Sequence[TokenHistory | None],
    vocab_size: int,
    device: torch.device,
    given: Penalties | None,
) -> Penalties | None:
    """This step's penalties of the ``penalised`` rows: ``given`` (the executor's slot buffer) when set, else built
    from their ``histories`` (ValueError when one is missing)."""
    if given is not None:
        return given
    subset = [params[i] for i in penalised]
    return prepare_penalties(subset, [histories[i] for i in penalised], vocab_size, device)


def _reuse(
    kept: SamplingBatch,
    memo: SamplingMemo,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    device: torch.device,
    penalties: Penalties | None,
) -> SamplingBatch:
    """The kept batch for this step: as it is, or (penalised rows) with this step's penalties."""
    if kept.penalised is None:
        return kept
    if penalties is None and len(histories) != len(params):
        raise ValueError(f"histories must have one entry per row, got {len(histories)} for {len(params)} rows")
    step = _step_penalties(params, memo.penalised, histories, kept.vocab_size, device, penalties)
    return attrs.evolve(kept, penalties=step)


def prepare_sampling(
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    histories: Sequence[TokenHistory | None],
    vocab_size: int,
    device: torch.device | str,
    penalties: Penalties | None = None,
    memo: SamplingMemo | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingBatch:
    """Build one step's SamplingBatch on `device` for the rows that sample, in batch order (one host -> device
    copy, plus the penalty lists when a row has a penalty).

    num_generated[i]: tokens row i generated before this draw (the counter of its seeded uniform; a row with
    fewer than its min_tokens may not draw ``eos_token_ids`` or its stop_token_ids).
    histories[i]: prompt and output tokens, required for rows with a penalty unless ``penalties`` is given,
    ignored otherwise. penalties: the penalised rows' penalties built elsewhere (the executor's per-slot token
    buffer, ``fnvllm.executor.history``); then ``histories`` is not read.
    memo: the last reusable batch (``SamplingMemo``): returned as it is when ``params`` is the sequence it was
    built for, and replaced by this one otherwise.
    Raises ValueError on mismatched lengths or a missing history, InvalidRequestError on out-of-vocab ids.
    """
    device = torch.device(device)
    kept = None if memo is None else memo.get(params, vocab_size, device)
    if kept is not None and memo is not None:
        return _reuse(kept, memo, params, histories, device, penalties)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    _check_lengths(params, num_generated, histories if penalties is None else [None] * len(params))
    num_rows = len(params)
    rows = _gather(params, vocab_size, num_generated)
    uniforms = np.zeros(num_rows, dtype=np.float32)
    if rows.seeded:
        seeds = [params[i].seed or 0 for i in rows.seeded]
        uniforms[rows.seeded] = seeded_uniforms(seeds, [num_generated[i] for i in rows.seeded])
    if not rows.penalised:
        penalties = None
    else:
        penalties = _step_penalties(params, rows.penalised, histories, vocab_size, device, penalties)
    views = _upload(rows, uniforms, _group_lists(rows, num_rows), device)
    scale, top_p, min_p, uniform, top_k, fixed, logprob_rows, *lists = views
    plain, penalised = _make_groups(lists, num_rows, len(rows.penalised))
    batch = SamplingBatch(
        scale=scale,
        top_p=top_p,
        min_p=min_p,
        uniforms=uniform,
        top_k=top_k,
        fixed=fixed,
        plain=plain,
        penalised=penalised,
        penalties=penalties,
        logprob_rows=logprob_rows if rows.logprobs else None,
        max_logprobs=rows.max_logprobs,
        vocab_size=vocab_size,
        num_rows=num_rows,
        candidates=_candidates(rows, vocab_size),
        min_p_only=not any(rows.top_k[i] or rows.top_p[i] < 1.0 for i in rows.filtered),
        logit_bias=_logit_bias(params, device, rows, eos_token_ids),
        allowed=prepare_allowed(params, rows.allowed, device) if rows.allowed else None,
        bad_words=prepare_bad_words(params, rows.penalised, device) if rows.penalised else None,
    )
    if memo is not None:  # seeded rows' uniforms and banned rows' bans change by step; penalties are swapped at reuse
        memo.keep(params, vocab_size, device, None if rows.seeded or rows.banned else batch, rows.penalised)
    return batch


def _logit_bias(
    params: Sequence[SamplingParams], device: torch.device, rows: _Rows, eos_token_ids: frozenset[int]
) -> LogitBias | None:
    """The step's LogitBias: the biased rows' biases and the banned rows' masks (None without either)."""
    if not rows.biased and not rows.banned:
        return None
    return prepare_logit_bias(params, device, rows.biased, rows.banned, eos_token_ids)


@attrs.frozen(eq=False)
class GraphRows:
    """A batch the decode CUDA graphs sample inside their replay (``fnvllm.executor.cuda_graphs.GraphSample``): every
    row by temperature (greedy rows included), some with a top-k (1 <= top_k <= the graphs' limit, with or without a
    top-p / min-p), none with a penalty, a logit bias, bad words, allowed token ids or a grammar. The graphs draw what
    ``fused_sampling.sample_with_kernels`` draws: ``sample_rows``, then ``segmented_pick`` for the top-k rows; the
    logprob rows' logprobs are then computed from the graph's logits as ``Sampler.sample`` computes them.

    scale: (B,) float32 inverse temperature, 0 = greedy. fixed: (B,) int32, 1 on the seeded rows. seeded: (S,)
    int64 those rows; seeds: their seeds. top_k / top_p / min_p: (B,) int32 / float32 / float32 with the neutral
    values 0 / 1 / 0 on unfiltered rows, or all None when no row filters. logprob_rows: the rows that asked for
    logprobs, ascending; max_logprobs: the most any of them asked (None when none did).
    """

    scale: np.ndarray
    fixed: np.ndarray
    seeded: np.ndarray
    seeds: tuple[int, ...]
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None
    logprob_rows: tuple[int, ...] = ()
    max_logprobs: int | None = None

    def uniforms(self, num_generated: Sequence[int]) -> np.ndarray:
        """(B,) float32: each seeded row's uniform for its draw number ``num_generated[row]`` (0 elsewhere)."""
        out = np.zeros(self.scale.shape[0], dtype=np.float32)
        if self.seeds:
            out[self.seeded] = seeded_uniforms(list(self.seeds), [num_generated[i] for i in self.seeded])
        return out


def graph_rows(params: Sequence[SamplingParams], vocab_size: int, max_top_k: int = 0) -> GraphRows | None:
    """The batch's GraphRows, or None when a row needs more than the graphs sample: a penalty, a logit bias, bad
    words, allowed token ids, a grammar, or a filter without a top-k in [1, max_top_k] (top-p or min-p alone, or a top-k
    past it). A row's min_tokens is not looked at: whether it still bans ids depends on the step (``banned_now``),
    so the caller asks that each step.
    Worked example (max_top_k 38): (T 0.6), (T 0, top_p 0.9), (T 1, seed 7) -> scale (1/0.6, 0, 1), fixed (0, 0, 1),
    no filters (a greedy row's are off); (T 0.6, top_k 20, top_p 0.95) -> top_k (20,), top_p (0.95,); (T 0.6,
    top_p 0.95) -> None."""
    rows = _gather(params, vocab_size)
    if rows.penalised or rows.biased or rows.allowed:
        return None
    if any(not 1 <= rows.top_k[i] <= max_top_k for i in rows.filtered):
        return None
    if any(p.structured is not None for p in params):
        return None
    fixed = np.zeros(len(params), dtype=np.int32)
    fixed[rows.seeded] = 1
    seeds = tuple(params[i].seed or 0 for i in rows.seeded)
    scale, seeded = np.array(rows.scale, dtype=np.float32), np.array(rows.seeded, dtype=np.int64)
    asked = tuple(rows.logprobs)
    if not rows.filtered:
        return GraphRows(scale, fixed, seeded, seeds, logprob_rows=asked, max_logprobs=rows.max_logprobs)
    top_k = np.array(rows.top_k, dtype=np.int32)
    top_p, min_p = np.array(rows.top_p, dtype=np.float32), np.array(rows.min_p, dtype=np.float32)
    return GraphRows(scale, fixed, seeded, seeds, top_k, top_p, min_p, asked, rows.max_logprobs)


def min_tokens_rows(params: Sequence[SamplingParams]) -> tuple[int, ...]:
    """The rows that have a min_tokens (whether they still ban ids depends on the step: ``banned_now``)."""
    return tuple(i for i, p in enumerate(params) if p.min_tokens)


def banned_now(params: Sequence[SamplingParams], num_generated: Sequence[int], rows: Sequence[int]) -> bool:
    """Whether one of ``rows`` (``min_tokens_rows(params)``) is still short of its min_tokens this step."""
    return any(num_generated[i] < params[i].min_tokens for i in rows)


TIE_MARGIN = 64  # candidates past the largest top-k: tokens tied with a row's k-th logit are kept, as by sorting


def _candidates(rows: _Rows, vocab_size: int) -> int | None:
    """``SamplingBatch.candidates`` of these rows."""
    ks = [rows.top_k[i] for i in rows.filtered]
    if not ks or not all(ks):
        return None
    return min(max(ks) + TIE_MARGIN, vocab_size)


def _has_triton() -> bool:
    """Triton ships with CUDA builds of torch; the CPU build may lack it."""
    return importlib.util.find_spec("triton") is not None


class Sampler:
    """Samples one token per row; owns the randomness of unseeded rows (Philox keys on the GPU, one
    torch.Generator per device for the references)."""

    def __init__(self, seed: int = 0, kernels: bool | None = None, filter_kernel: bool = False) -> None:
        """`seed` seeds unseeded rows (seeded rows never touch it). kernels: run the Triton kernels (True), their
        torch references (False), or the kernels on CUDA tensors when Triton is installed (None). filter_kernel:
        filtered rows by the Triton filter kernel instead of sorting on the device (``sample_with_kernels``)."""
        self.seed = seed
        self.kernels = kernels
        self.filter_kernel = filter_kernel
        self._has_triton = _has_triton()
        self._calls = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._scratch: SamplingScratch | None = None  # the kernels' device scratch, kept between steps

    def _generator(self, device: torch.device) -> torch.Generator:
        """The references' generator for `device`, created on first use."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def uses_kernels(self, device: torch.device) -> bool:
        """Whether sampling on ``device`` runs the Triton kernels (else their torch references)."""
        return self.kernels if self.kernels is not None else device.type == "cuda" and self._has_triton

    def next_key(self) -> int:
        """The Philox key of the next kernel-sampled step's unseeded rows, in [0, 2**31); each call takes one
        (the decode CUDA graphs take theirs here too, so a step draws the same uniforms on either path)."""
        key = (self.seed * 1_000_003 + self._calls) % 2**31
        self._calls += 1
        return key

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` (B, V) (read in its dtype, computed in float32); the input tensor is
        not modified. Rows with a ``batch.logit_bias`` have it added first, then ``batch.bad_words`` bans the
        last id of each word whose rest ends the row's output; rows with ``batch.allowed`` token ids and rows
        under ``batch.grammar_mask`` then sample only their allowed tokens (logprobs stay raw: neither bias nor
        masks)."""
        expected = (batch.num_rows, batch.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits must have shape (num_rows, vocab_size) = {expected}, got {tuple(logits.shape)}")
        raw = logits
        if batch.logit_bias is not None:
            logits = apply_logit_bias(logits, batch.logit_bias)
        if batch.bad_words is not None:
            view = None if batch.penalties is None else batch.penalties.token_view()
            if view is None:
                raise ValueError("a batch with bad words of several ids needs its rows' tokens (penalties.token_view)")
            logits = apply_bad_words(logits, batch.bad_words, view, copy=logits is raw)
        if batch.allowed is not None:
            logits = apply_allowed(logits, batch.allowed, copy=logits is raw)
        mask = batch.grammar_mask
        if mask is not None:
            # in place on a copy already made (bias), or on the caller's scratch logits when no row reads them raw
            scratch = logits is not raw or (mask.scratch and batch.logprob_rows is None)
            logits = apply_grammar_mask(logits, attrs.evolve(mask, scratch=scratch), self.uses_kernels(logits.device))
        if self.uses_kernels(logits.device):
            key = self.next_key()
            packed = sample_with_kernels(logits, batch, key, self.filter_kernel, self.scratch())
        else:
            packed = sample_with_references(logits, batch, self._generator(logits.device))
        rows, num_top = batch.logprob_rows, batch.max_logprobs
        if rows is None or num_top is None:
            return SamplerOutput(packed=packed, logprobs=None)
        return SamplerOutput(packed=packed, logprobs=self.logprobs(raw, packed[0], rows, num_top))

    def logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, num_top: int) -> Logprobs:
        """``compute_logprobs`` of the raw ``logits`` (B, V) for ``rows`` ((L,) ascending) and the sampled
        ``token_ids`` (B,), on this sampler's backend and scratch: what ``sample`` returns for its logprob rows.
        The decode graphs' logprob rows come here without an eager ``sample`` before them, so the scratch is made
        here too when missing (a fresh one each step re-allocated and zero-filled its buffers)."""
        kernels = self.uses_kernels(logits.device)
        return compute_logprobs(logits, token_ids, rows, num_top, kernels, self.scratch() if kernels else None)

    def scratch(self) -> SamplingScratch:
        """The kernels' device scratch, made on first use and kept between steps."""
        if self._scratch is None:
            from fnvllm.kernels.sampling import SamplingScratch

            self._scratch = SamplingScratch()
        return self._scratch


# The largest chunk of ``logprob_candidates``: each row's top-n come from its n best chunks of this many tokens,
# so a smaller chunk means fewer candidates to gather and sort (n x chunk per row) but more chunk summaries.
LOGPROB_MAX_CHUNK = 1024
# The most candidates per row the chunk is chosen for (when a chunk allows it): torch.topk over the candidates takes
# its multi-block path (per radix pass two launches, two CUB scans with their allocations, a memset: ~0.2 ms of host
# time per call, cProfile of benchmarks/host_step.py --logprobs 5 at 256 rows on the H200) for 200-799 rows of
# >= 3000 candidates (80-199 rows: >= 5000), and one launch (plus the sort of the n results) below that.
LOGPROB_MAX_CANDIDATES = 2560


def _logprob_chunk(vocab: int, num_top: int) -> int | None:
    """The chunk of ``logprob_candidates`` for these rows: the largest power of two up to LOGPROB_MAX_CHUNK whose
    num_top chunks stay within a quarter of the row, in at most 1024 chunks, and hold at most
    LOGPROB_MAX_CANDIDATES candidates (when no such chunk holds that few: the smallest of the others). None: no
    such chunk, torch.topk on whole rows."""
    n = max(num_top, 1)
    chunks = [LOGPROB_MAX_CHUNK >> i for i in range(LOGPROB_MAX_CHUNK.bit_length()) if LOGPROB_MAX_CHUNK >> i >= 16]
    valid = [c for c in chunks if n * c * 4 <= vocab and -(-vocab // c) <= 1024]  # largest first
    if not valid:
        return None
    few = [c for c in valid if n * c <= LOGPROB_MAX_CANDIDATES]
    return few[0] if few else valid[-1]


def compute_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    num_top: int,
    kernels: bool = False,
    scratch: SamplingScratch | None = None,
) -> Logprobs:
    """Top-`num_top` and sampled-token log-probabilities of the raw logits (B, V) for rows ``rows`` ((L,) distinct,
    ascending), given the sampled token_ids (B,). With ``kernels`` two launches (``fnvllm.kernels.sampling.
    logprob_top``: one pass over every chunk of those rows, then per row its log-partition, its n best chunks and
    their n best logits; torch.topk over whole rows took 0.43 ms at 256 x 151,936 on the H200) into one packed
    tensor (``Logprobs.packed``), with ``scratch`` (``SamplingScratch``) its reused device scratch; otherwise from
    logsumexp and torch.topk over the rows."""
    vocab = logits.shape[1]
    chunk = _logprob_chunk(vocab, num_top) if kernels else None
    if chunk is not None:
        from fnvllm.kernels.sampling import logprob_top

        values, ids, sampled, packed = logprob_top(logits, rows, num_top, chunk, token_ids, scratch)
        return Logprobs(top_logprobs=values, top_ids=ids, sampled_logprobs=sampled, packed=packed)
    chosen = torch.take(logits, rows.long() * vocab + token_ids.index_select(0, rows)).float()  # (L,)
    subset = logits if rows.shape[0] == logits.shape[0] else logits.index_select(0, rows)  # (L, V)
    lse = log_partition_ref(subset)
    top_values, top_ids = subset.topk(num_top, dim=-1)
    return Logprobs(
        top_logprobs=top_values.float() - lse[:, None],
        top_ids=top_ids,
        sampled_logprobs=chosen - lse,
    )
