"""Hypothesis strategies for the pure core: configs, sampling parameters, prompts and sampled-token streams.

They are sized to find scheduler bugs, not to look like production: block sizes down to 1, pools of a handful
of blocks (so sequences get preempted), token budgets of a few tokens (so prompts get chunked), tiny
vocabularies (so EOS and stop ids are actually sampled) and prompts that share prefixes drawn from one common
pool (so the prefix cache gets hits). Reuse them to test your own policy or executor::

    @given(config=core_configs(), data=st.data())
    def test_my_policy(config, data):
        request = data.draw(requests(config))  # valid under config: fits max_model_len and the pool
        work = data.draw(workloads(config))     # several, sharing prefixes

Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from fnvllm.state.config import CoreConfig
from fnvllm.state.hashing import BlockHasher, hash_block_xxh3
from fnvllm.state.params import SamplingParams

Tokens = tuple[int, ...]
Prefixes = Sequence[Tokens]


def small_or_any(low: int, small: int, high: int) -> st.SearchStrategy[int]:
    """Integers in [low, high], drawn from [low + 1, small] half of the time so tiny values (but not only the
    extreme ``low``, which Hypothesis favours anyway) are common."""
    lower = min(low + 1, high)
    return st.one_of(st.integers(lower, max(lower, min(small, high))), st.integers(low, high))


@st.composite
def core_configs(
    draw: st.DrawFn,
    *,
    max_block_size: int = 8,
    max_num_blocks: int = 24,
    max_num_seqs: int = 6,
    min_num_seqs: int = 1,
    max_budget: int = 24,
    max_model_len: int = 40,
    max_vocab_size: int = 24,
    enable_prefix_caching: st.SearchStrategy[bool] | None = None,
    hashers: st.SearchStrategy[BlockHasher] | None = None,
) -> CoreConfig:
    """CoreConfigs that stress the scheduler: block size 1.., pools of 1.. blocks, budgets of 1.. tokens,
    max_num_seqs 1..N, prefix caching on and off, 0-2 EOS ids inside a vocabulary of 4.. ids."""
    vocab_size = draw(st.integers(4, max(4, max_vocab_size)))
    block_size = draw(st.one_of(st.just(1), small_or_any(1, 4, max_block_size)))
    num_blocks = draw(small_or_any(1, 8, max_num_blocks))
    # Half the time the pool, not max_model_len, bounds a request: one long request then fills it.
    pool_bound = min(num_blocks * block_size + 1, max_model_len)
    return CoreConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=draw(small_or_any(1, 6, max_budget)),
        max_num_seqs=draw(st.integers(min_num_seqs, max(min_num_seqs, max_num_seqs))),
        max_model_len=draw(st.one_of(st.integers(2, max_model_len), st.integers(max(2, pool_bound), max_model_len))),
        enable_prefix_caching=draw(enable_prefix_caching if enable_prefix_caching is not None else st.booleans()),
        eos_token_ids=frozenset(draw(st.lists(st.integers(0, vocab_size - 1), max_size=2))),
        vocab_size=vocab_size,
        hash_block=draw(hashers if hashers is not None else st.just(hash_block_xxh3)),
    )


def max_request_len(config: CoreConfig) -> int:
    """The longest prompt + max_tokens that ``add_request`` accepts under ``config`` (max_model_len and pool)."""
    # The last generated token is never fed, so a request of n tokens needs blocks for n - 1 of them.
    return min(config.max_model_len, config.num_blocks * config.block_size + 1)


def vocab_of(config: CoreConfig) -> int:
    """The vocabulary size to draw token ids from (the config's, or 32 when it sets none)."""
    return config.vocab_size if config.vocab_size is not None else 32


def token_lists(vocab_size: int, min_size: int = 0, max_size: int = 16) -> st.SearchStrategy[Tokens]:
    """Tuples of token ids in [0, vocab_size)."""
    return st.lists(st.integers(0, vocab_size - 1), min_size=min_size, max_size=max_size).map(tuple)


def prefix_pools(vocab_size: int, max_len: int = 16, max_prefixes: int = 3) -> st.SearchStrategy[tuple[Tokens, ...]]:
    """A few token sequences that prompts start from, so that different prompts share prefixes."""
    return st.lists(token_lists(vocab_size, 1, max(max_len, 1)), min_size=1, max_size=max_prefixes).map(tuple)


@st.composite
def prompts(
    draw: st.DrawFn,
    *,
    vocab_size: int = 16,
    max_len: int = 16,
    min_len: int = 1,
    prefixes: Prefixes | st.SearchStrategy[tuple[Tokens, ...]] | None = None,
) -> Tokens:
    """Prompts of min_len..max_len ids; most start with a slice of a prefix from ``prefixes``.

    ``prefixes`` is a concrete list, a strategy, or None: a pool shared by every prompt drawn in one test case
    (``st.shared``), which is what makes two prompts of one test case share cached blocks.
    """
    if prefixes is None:
        key = f"fnvllm.testing.prompts.prefixes/{vocab_size}/{max_len}"
        prefixes = st.shared(prefix_pools(vocab_size, max_len), key=key)
    pool = draw(prefixes) if isinstance(prefixes, st.SearchStrategy) else prefixes
    length = draw(small_or_any(min_len, min_len + 3, max(min_len, max_len)))  # short prompts decode long
    base: Tokens = ()
    if pool and draw(st.integers(0, 3)) > 0:  # 3 in 4 prompts reuse a prefix, most of them all of it
        prefix = draw(st.sampled_from(list(pool)))[:length]
        base = prefix if draw(st.booleans()) else prefix[: draw(st.integers(0, len(prefix)))]
    return base + draw(token_lists(vocab_size, length - len(base), length - len(base)))


PENALTY_KINDS = ("none", "repetition", "presence", "frequency", "all")


@st.composite
def sampling_params(
    draw: st.DrawFn, *, max_tokens: int = 8, vocab_size: int | None = 16, max_stop_ids: int = 2
) -> SamplingParams:
    """SamplingParams with max_tokens in [1, max_tokens], sometimes ignore_eos, stop_token_ids or a min_tokens.

    Every sampler-only option varies too, since the core must pass them through untouched and the plan must
    carry token histories exactly for the rows with a penalty: greedy or not (temperature 0, a tiny one below
    GREEDY_TEMPERATURE, or 1), top-k / top-p / min-p, a seed, logprobs, and each penalty alone (repetition,
    presence, frequency) or all together, and sometimes bad words (one id, or sequences the sampler matches
    against the output's history).
    """
    stop_ids: Tokens = ()
    if vocab_size is not None and max_stop_ids and draw(st.integers(0, 3)) == 0:
        stop_ids = draw(token_lists(vocab_size, 1, max_stop_ids))
    bad_words: tuple[Tokens, ...] = ()
    if vocab_size is not None and draw(st.integers(0, 5)) == 0:  # one id (banned always) or a sequence (history)
        bad_words = tuple(draw(st.lists(token_lists(vocab_size, 1, 3), min_size=1, max_size=2)))
    penalty = draw(st.sampled_from(PENALTY_KINDS))
    num_tokens = draw(st.integers(1, max(max_tokens, 1)))
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 1.0, 1.0, 0.5, 1e-7])),
        top_k=draw(st.one_of(st.none(), st.integers(1, max(vocab_size or 8, 1) + 2))),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.1])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**32))),
        logprobs=draw(st.one_of(st.none(), st.integers(0, min(3, vocab_size or 3)))),
        max_tokens=num_tokens,
        min_tokens=draw(st.integers(0, num_tokens)) if draw(st.integers(0, 3)) == 0 else 0,
        ignore_eos=draw(st.integers(0, 3)) > 0,  # mostly: long runs are what fill the pool
        stop_token_ids=stop_ids,
        repetition_penalty=1.1 if penalty in ("repetition", "all") else 1.0,
        presence_penalty=0.5 if penalty in ("presence", "all") else 0.0,
        frequency_penalty=-0.5 if penalty in ("frequency", "all") else 0.0,
        bad_words_token_ids=bad_words,
    )


def uses_history(params: SamplingParams) -> bool:
    """Whether a request's rows must carry its token history, spelled out from the penalty fields and the bad words
    (an independent reference for ``SamplingParams.needs_history``)."""
    penalised = not (params.repetition_penalty == 1 and params.presence_penalty == 0 and params.frequency_penalty == 0)
    return penalised or max(map(len, params.bad_words_token_ids), default=0) >= 2


def token_ids(vocab_size: int, eos_token_ids: Sequence[int] = ()) -> st.SearchStrategy[int]:
    """One sampled token id in [0, vocab_size); an EOS id one time in eight when there are any."""
    any_id = st.integers(0, vocab_size - 1)
    if not eos_token_ids:
        return any_id
    return st.one_of(*[any_id] * 7, st.sampled_from(sorted(eos_token_ids)))


def token_streams(
    vocab_size: int, eos_token_ids: Sequence[int] = (), *, min_size: int = 0, max_size: int | None = None
) -> st.SearchStrategy[list[int]]:
    """Lists of sampled token ids, as an executor would return them (EOS ids mixed in)."""
    return st.lists(token_ids(vocab_size, eos_token_ids), min_size=min_size, max_size=max_size)


def sampled_for(config: CoreConfig, num_samples: int) -> st.SearchStrategy[list[int]]:
    """Exactly ``num_samples`` token ids for one step under ``config`` (EOS ids from the config mixed in)."""
    return token_streams(vocab_of(config), sorted(config.eos_token_ids), min_size=num_samples, max_size=num_samples)


@attrs.frozen
class RequestDraw:
    """One drawn request: prompt, params and priority (ids are assigned by whoever adds it)."""

    prompt: Tokens
    params: SamplingParams
    priority: int = 0


@st.composite
def requests(
    draw: st.DrawFn, config: CoreConfig, prefixes: Prefixes | st.SearchStrategy[tuple[Tokens, ...]] | None = None
) -> RequestDraw:
    """A request that ``add_request`` accepts under ``config`` (fits max_model_len and the pool)."""
    limit = max_request_len(config)
    vocab = vocab_of(config)
    # Long requests are what fill a tiny pool, so half of them take (nearly) all the room there is.
    total = draw(st.one_of(st.integers(2, limit), st.integers(max(2, limit * 3 // 4), limit)))
    prompt = draw(prompts(vocab_size=vocab, min_len=1, max_len=total - 1, prefixes=prefixes))
    params = draw(sampling_params(max_tokens=total - len(prompt), vocab_size=vocab))
    return RequestDraw(prompt, attrs.evolve(params, max_tokens=total - len(prompt)), draw(st.integers(0, 3)))


def workloads(config: CoreConfig, *, min_size: int = 1, max_size: int = 6) -> st.SearchStrategy[list[RequestDraw]]:
    """Lists of valid requests under ``config`` whose prompts share prefixes from one pool."""
    limit = max_request_len(config)
    pool = prefix_pools(vocab_of(config), max(limit - 1, 1))
    return pool.flatmap(lambda p: st.lists(requests(config, p), min_size=min_size, max_size=max_size))


@attrs.frozen
class InvalidRequest:
    """A request ``add_request`` must reject: what is wrong with it (``kind``) and its arguments."""

    kind: str
    request_id: str
    prompt: Tokens
    params: SamplingParams


@st.composite
def invalid_requests(draw: st.DrawFn, config: CoreConfig, live_ids: Sequence[str] = ()) -> InvalidRequest:
    """Requests that break exactly one rule of ``validate_request`` under ``config``: empty prompt, token outside
    the vocabulary, longer than max_model_len, more blocks than the pool, a live id, an empty id."""
    kinds = ["empty_prompt", "token_out_of_vocab", "too_long", "empty_id"]
    pool_total = config.num_blocks * config.block_size + 2  # needs num_blocks + 1 blocks
    kinds += ["too_big_for_pool"] if pool_total <= config.max_model_len else []
    kinds += ["duplicate_id"] if live_ids else []
    kind = draw(st.sampled_from(kinds))
    rid, params = "bad", SamplingParams(max_tokens=1)
    prompt: Tokens = (0,)
    if kind == "empty_prompt":
        prompt = ()
    elif kind == "token_out_of_vocab":
        prompt = (draw(st.sampled_from([-1, vocab_of(config), vocab_of(config) + 7])),)
    elif kind in ("too_long", "too_big_for_pool"):
        total = config.max_model_len + 1 if kind == "too_long" else pool_total
        n = draw(st.integers(1, total - 1))
        prompt, params = (0,) * n, SamplingParams(max_tokens=total - n)
    elif kind == "duplicate_id":
        rid = draw(st.sampled_from(list(live_ids)))
    else:
        rid = ""
    return InvalidRequest(kind, rid, prompt, params)
