"""CoreConfig: the static settings the pure core schedules with. Frozen; never written after construction."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from fnvllm.state.errors import InvalidConfigError
from fnvllm.state.hashing import BlockHasher, hash_block_xxh3


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or value < minimum:
            raise InvalidConfigError(f"CoreConfig.{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _as_frozenset(values: object) -> frozenset[int]:
    """EOS ids as a frozenset: one integer or an iterable of integers (anything with ``__index__``), each >= 0."""
    message = f"CoreConfig.eos_token_ids must be an int or ints >= 0, got {values!r}"
    if isinstance(values, (str, bytes)):
        raise InvalidConfigError(message)
    items: Iterable[Any] = values if isinstance(values, Iterable) else (values,)
    try:
        ids = frozenset(operator.index(v) for v in items)
    except TypeError:
        raise InvalidConfigError(message) from None
    if any(i < 0 for i in ids):
        raise InvalidConfigError(message)
    return ids


def _none_or_at_least_1(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise InvalidConfigError(f"CoreConfig.{attribute.name} must be None or an int >= 1, got {value!r}")


@attrs.frozen
class CoreConfig:
    """Settings of the scheduler and block pool.

    block_size: tokens per KV block (>= 1).
    num_blocks: KV blocks in the pool (>= 1).
    max_num_batched_tokens: token budget of one step, prefill chunks and decodes together (>= 1).
    max_num_seqs: cap on the number of running sequences (>= 1).
    max_model_len: cap on prompt + generated tokens of one request (>= 1).
    enable_prefix_caching: reuse full KV blocks whose chained hash and tokens match.
    eos_token_ids: ids that end a request unless its params set ignore_eos.
    vocab_size: when set, prompt ids must lie in [0, vocab_size).
    hash_block: the chained block hash, injectable so tests can plant collisions.
    """

    block_size: int = attrs.field(default=16, validator=_at_least(1))
    num_blocks: int = attrs.field(default=1024, validator=_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_at_least(1))
    max_num_seqs: int = attrs.field(default=256, validator=_at_least(1))
    max_model_len: int = attrs.field(default=4096, validator=_at_least(1))
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_as_frozenset)
    vocab_size: int | None = attrs.field(default=None, validator=_none_or_at_least_1)
    hash_block: BlockHasher = hash_block_xxh3
