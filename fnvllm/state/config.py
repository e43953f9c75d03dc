"""CoreConfig: the static settings the pure core schedules with. Frozen; never written after construction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from fnvllm.state.checks import CONFIG, check_bool, check_int, check_optional_int, fail, is_int
from fnvllm.state.hashing import BlockHasher, hash_block_xxh3

# Upper ends of the size ranges: far above any real deployment, and low enough that what the core builds from a
# size at its extreme still fits in memory (the pool's free queue holds num_blocks ids; commit keeps a table of
# max_model_len + 2 lengths), so an absurd value is an error here rather than a MemoryError mid-run.
MAX_NUM_BLOCKS = 1 << 24
MAX_MODEL_LEN = 1 << 21
MAX_NUM_SEQS = 1 << 16  # running requests, each with a slot (the executor keeps per-slot device state)
MAX_SIZE = (1 << 31) - 1


def _block_size(value: Any) -> int:
    return check_int(value, "CoreConfig.block_size", CONFIG, 1, MAX_SIZE)


def _num_blocks(value: Any) -> int:
    return check_int(value, "CoreConfig.num_blocks", CONFIG, 1, MAX_NUM_BLOCKS)


def _budget(value: Any) -> int:
    return check_int(value, "CoreConfig.max_num_batched_tokens", CONFIG, 1, MAX_SIZE)


def _max_num_seqs(value: Any) -> int:
    return check_int(value, "CoreConfig.max_num_seqs", CONFIG, 1, MAX_NUM_SEQS)


def _max_model_len(value: Any) -> int:
    return check_int(value, "CoreConfig.max_model_len", CONFIG, 1, MAX_MODEL_LEN)


def _vocab_size(value: Any) -> int | None:
    return check_optional_int(value, "CoreConfig.vocab_size", CONFIG, 1, MAX_SIZE)


def _as_frozenset(values: object) -> frozenset[int]:
    """EOS ids as a frozenset: one int or an iterable of ints (numpy integers too, never bools), each >= 0."""
    allowed = "an int or a list of ints >= 0"
    if isinstance(values, (str, bytes, bytearray, dict)) or not (is_int(values) or isinstance(values, Iterable)):
        raise fail(CONFIG, "CoreConfig.eos_token_ids", allowed, values, wrong_type=True)
    items: list[Any] = list(values) if isinstance(values, Iterable) else [values]
    for item in items:
        if not is_int(item):
            raise fail(CONFIG, "CoreConfig.eos_token_ids", allowed, values, wrong_type=True)
        if not 0 <= item <= MAX_SIZE:
            raise fail(CONFIG, "CoreConfig.eos_token_ids", f"ints in [0, {MAX_SIZE}]", values)
    return frozenset(int(item) for item in items)


@attrs.frozen
class CoreConfig:
    """Settings of the scheduler and block pool.

    Fields are checked strictly (bools are not sizes, floats are not ints; InvalidConfigError, ConfigTypeError
    for a wrong type, naming the field, the range and the value).

    block_size: tokens per KV block, in [1, 2**31).
    num_blocks: KV blocks in the pool, in [1, 2**24].
    max_num_batched_tokens: token budget of one step, prefill chunks and decodes together, in [1, 2**31).
    max_num_seqs: cap on the number of running sequences, in [1, 65536] (each holds a slot).
    max_model_len: cap on prompt + generated tokens of one request, in [1, 2**21].
    enable_prefix_caching: reuse full KV blocks whose chained hash and tokens match.
    eos_token_ids: ids that end a request unless its params set ignore_eos (inside the vocabulary when it is
        known).
    vocab_size: when set, prompt ids, sampled ids and stop ids must lie in [0, vocab_size).
    hash_block: the chained block hash, injectable so tests can plant collisions.
    """

    block_size: int = attrs.field(default=16, converter=_block_size)
    num_blocks: int = attrs.field(default=1024, converter=_num_blocks)
    max_num_batched_tokens: int = attrs.field(default=8192, converter=_budget)
    max_num_seqs: int = attrs.field(default=256, converter=_max_num_seqs)
    max_model_len: int = attrs.field(default=4096, converter=_max_model_len)
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_as_frozenset)
    vocab_size: int | None = attrs.field(default=None, converter=_vocab_size)
    hash_block: BlockHasher = hash_block_xxh3

    def __attrs_post_init__(self) -> None:
        """Cross-field checks: EOS ids inside the vocabulary, a callable hasher, a bool switch."""
        check_bool(self.enable_prefix_caching, "CoreConfig.enable_prefix_caching", CONFIG)
        if self.vocab_size is not None and any(i >= self.vocab_size for i in self.eos_token_ids):
            allowed = f"ids in [0, vocab_size) = [0, {self.vocab_size})"
            raise fail(CONFIG, "CoreConfig.eos_token_ids", allowed, sorted(self.eos_token_ids))
        if not callable(self.hash_block):
            raise fail(CONFIG, "CoreConfig.hash_block", "a callable BlockHasher", self.hash_block, wrong_type=True)
