"""The candidate chunk of the logprobs' top-n (``_logprob_chunk``): few enough candidates per row that torch.topk
stays on its one-launch path, and a chunk for every count the vocabulary allows."""

from __future__ import annotations

import pytest

from fnvllm.executor import sampler
from fnvllm.executor.sampler import LOGPROB_MAX_CANDIDATES, _logprob_chunk

QWEN_VOCAB = 151_936


@pytest.mark.parametrize("num_top", [0, 1, 2, 3, 5, 8, 10])
def test_chunk_keeps_candidates_under_the_cap(num_top: int) -> None:
    """For the counts users send at Qwen3's vocabulary, the chunk is the largest power of two whose candidates
    (n x chunk) stay within the cap, in at most 1024 chunks of the row."""
    chunk = _logprob_chunk(QWEN_VOCAB, num_top)
    assert chunk is not None and chunk & (chunk - 1) == 0 and -(-QWEN_VOCAB // chunk) <= 1024
    n = max(num_top, 1)
    assert n * chunk <= LOGPROB_MAX_CANDIDATES
    assert chunk == sampler.LOGPROB_MAX_CHUNK or n * 2 * chunk > LOGPROB_MAX_CANDIDATES


def test_chunk_past_the_cap_takes_the_smallest_valid_one() -> None:
    """When no chunk holds n x chunk under the cap in at most 1024 chunks (n 20 at 151,936 tokens), the smallest
    chunk that fits the row's 1024 chunks is used, not whole-row torch.topk; a row too small for n chunks of 16
    gets None."""
    assert _logprob_chunk(QWEN_VOCAB, 20) == 256  # 128 would need 1187 chunks
    assert _logprob_chunk(64, 2) is None and _logprob_chunk(64, 1) == 16
