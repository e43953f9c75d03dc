"""The executor's host conversion of a step's logprob tensors into per-row TokenLogprobs (``_host_logprobs``)."""

from __future__ import annotations

import torch

from fnvllm.executor.base import TokenLogprobs
from fnvllm.executor.model_executor import _host_logprobs
from fnvllm.executor.sampler import Logprobs


def _logprobs(num_rows: int, width: int) -> Logprobs:
    """Distinct, recognisable values: row k's j-th entry is id 100 k + j with logprob -(k + j / 10)."""
    ids = torch.tensor([[100 * k + j for j in range(width)] for k in range(num_rows)], dtype=torch.int64)
    values = torch.tensor([[-(k + j / 10) for j in range(width)] for k in range(num_rows)], dtype=torch.float32)
    sampled = torch.tensor([-0.5 * k for k in range(num_rows)], dtype=torch.float32)
    return Logprobs(values.reshape(num_rows, width), ids.reshape(num_rows, width), sampled)


def _expected(lp: Logprobs, tokens: list[int], asked: tuple[int | None, ...]) -> tuple[TokenLogprobs | None, ...]:
    """The per-row reference: one TokenLogprobs per row that asked, its first n entries."""
    out: list[TokenLogprobs | None] = []
    k = 0
    for i, n in enumerate(asked):
        if n is None:
            out.append(None)
            continue
        ids, values = lp.top_ids[k, :n].tolist(), lp.top_logprobs[k, :n].tolist()
        out.append(TokenLogprobs(tokens[i], float(lp.sampled_logprobs[k]), tuple(zip(ids, values, strict=True))))
        k += 1
    return tuple(out)


def test_every_row_asking_the_same_count() -> None:
    """When every row asked for the tensors' width, each row gets its own sampled logprob and top entries."""
    lp, tokens = _logprobs(4, 3), [7, 8, 9, 10]
    got = _host_logprobs(lp, tokens, (3, 3, 3, 3))
    assert got == _expected(lp, tokens, (3, 3, 3, 3))
    assert got[2] == TokenLogprobs(9, -1.0, ((200, -2.0), (201, _f32(-2.1)), (202, _f32(-2.2))))


def _f32(value: float) -> float:
    """``value`` rounded through float32, as the tensors hold it."""
    return torch.tensor(value, dtype=torch.float32).item()


def test_mixed_counts_and_rows_that_did_not_ask() -> None:
    """Rows asking fewer entries keep the first ones, rows that did not ask get None, and n 0 gives no top."""
    asked = (2, None, 0, 2, None)
    lp, tokens = _logprobs(3, 2), [1, 2, 3, 4, 5]
    got = _host_logprobs(lp, tokens, asked)
    assert got == _expected(lp, tokens, asked)
    assert got[1] is None and got[2] is not None and got[2].top == ()


def test_every_row_asking_zero() -> None:
    """logprobs=0 on every row: the sampled token's logprob with an empty top list."""
    lp, tokens = _logprobs(2, 0), [4, 5]
    got = _host_logprobs(lp, tokens, (0, 0))
    assert got == (TokenLogprobs(4, 0.0, ()), TokenLogprobs(5, -0.5, ()))
