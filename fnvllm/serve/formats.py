"""Response bodies of the OpenAI API: ``text_completion`` and ``chat.completion`` (+ ``.chunk`` when streamed).

One format object per HTTP request knows its id, creation time, model name and tokenizer, and renders the events
of its ``RequestStream``s as chunks (each naming its choice's index), or the finished choices as one final body.
A server without a tokenizer (a checkpoint folder with no tokenizer files) has no text to send: its completion
choices carry the generated ids as ``token_ids`` (vLLM's field name) and ``text`` stays empty.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from fnvllm.executor.base import TokenLogprobs


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


Scored = TokenLogprobs | int
"""A logprobs entry of a completion: a scored token, or a bare token id that has no logprob (the first token of
an echoed prompt), rendered with null logprobs."""


def echoed_logprobs(ids: Sequence[int], scored: Sequence[TokenLogprobs | None] | None) -> tuple[Scored, ...]:
    """The logprobs entries of an echoed prompt: each scored token, or its bare id where it has no score (the
    first; every one when the engine returned no prompt logprobs)."""
    entries = scored or (None,) * len(ids)
    return tuple(token if entry is None else entry for token, entry in zip(ids, entries, strict=True))


@attrs.frozen
class Choice:
    """One finished choice of a non-streamed answer: its index in ``choices``, text (with the echoed prompt, if
    asked), generated ids, logprobs (None when not asked for; with echo, the prompt's entries first) and finish
    reason. prompt_logprobs: the prompt's, when the engine request asked (``RequestOutput.prompt_logprobs``)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Scored, ...] | None
    finish_reason: str | None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


class _Format:
    """Shared fields of one response: id, creation time (unix seconds), model name, tokenizer. ``chunk_object``:
    the ``object`` of its streamed chunks."""

    chunk_object = ""

    def __init__(self, request_id: str, model: str, tokenizer: Any) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.created = int(time.time())

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": counts}

    def _chunk(self, choice: dict[str, Any], counts: dict[str, int] | None) -> dict[str, Any]:
        chunk = {**self._head(self.chunk_object), "choices": [choice]}
        if counts is not None:  # stream_options.continuous_usage_stats: the counts so far, in every chunk
            chunk["usage"] = counts
        return chunk


class CompletionFormat(_Format):
    """``/v1/completions`` bodies; logprobs in the legacy shape (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, tokenizer: Any) -> None:
        super().__init__(request_id, model, tokenizer)
        self._offsets: dict[int, int] = {}  # per choice: characters of token text rendered so far

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (none for completions)."""
        return []

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[Scored] | None,
        finish_reason: str | None,
        counts: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``; ``token_ids`` only without a tokenizer."""
        return self._chunk(self._choice(index, text, token_ids, logprobs, finish_reason), counts)

    def _choice(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[Scored] | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        logprobs_json = self.logprobs(index, logprobs)
        choice = {"index": index, "text": text, "logprobs": logprobs_json, "finish_reason": finish_reason}
        if self.tokenizer is None:
            choice["token_ids"] = list(token_ids)
        return choice

    def final(self, choices: Sequence[Choice], counts: dict[str, int]) -> dict[str, Any]:
        """The non-streamed body."""
        rendered = [self._choice(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in choices]
        return {**self._head(self.chunk_object), "choices": rendered, "usage": counts}

    def logprobs(self, index: int, logprobs: Sequence[Scored] | None) -> dict[str, Any] | None:
        """Legacy logprobs of these tokens of choice ``index``, or None when the request did not ask for them; a
        bare token id (an unscored prompt token) has null token_logprobs and top_logprobs."""
        if logprobs is None:
            return None
        tokens = [self._token_text(lp if isinstance(lp, int) else lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if isinstance(lp, int) else lp.logprob for lp in logprobs],
            "top_logprobs": [None if isinstance(lp, int) else self._top(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top(self, lp: TokenLogprobs) -> dict[str, float]:
        """The top entries of one position as {token text: logprob}, best first, and the sampled token last when it
        is not among them: the legacy API always returns the sampled token's logprob, so logprobs=k gives up to
        k + 1 entries (and logprobs=0 the sampled token alone)."""
        top = {self._token_text(t): v for t, v in lp.top}
        if all(t != lp.token_id for t, _ in lp.top):
            top.setdefault(self._token_text(lp.token_id), lp.logprob)
        return top


class ChatFormat(_Format):
    """``/v1/chat/completions`` bodies; logprobs as ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    chunk_object = "chat.completion.chunk"

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """The first streamed chunk of each choice announces the assistant role."""
        return [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, None)
            for i in range(num_choices)
        ]  # fmt: skip

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
        counts: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: a content delta (empty on the last one when it carries no
        text). Chat always has a tokenizer (its template), so ``token_ids`` is not sent."""
        delta = {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return self._chunk(choice, counts)

    def final(self, choices: Sequence[Choice], counts: dict[str, int]) -> dict[str, Any]:
        """The non-streamed body."""
        rendered = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return {**self._head("chat.completion"), "choices": rendered, "usage": counts}

    def logprobs(self, logprobs: Sequence[Scored] | None) -> dict[str, Any] | None:
        """Chat logprobs of these tokens, or None when the request did not ask for them (chat echoes no prompt,
        so every entry is scored; a bare id would be skipped)."""
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            if isinstance(lp, int):
                continue
            top = [self._entry(t, v) for t, v in lp.top]
            content.append({**self._entry(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
