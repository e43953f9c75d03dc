"""Response bodies of the OpenAI API: ``text_completion`` and ``chat.completion`` (+ ``.chunk`` when streamed).

One format object per request knows its id, creation time, model name and tokenizer, and renders the events of
its ``RequestStream`` as chunks, or their concatenation as one final body. A server without a tokenizer (a
checkpoint folder with no tokenizer files) has no text to send: its completion choices carry the generated ids as
``token_ids`` (vLLM's field name) and ``text`` stays empty.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fnvllm.executor.base import TokenLogprobs


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


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


class CompletionFormat(_Format):
    """``/v1/completions`` bodies; logprobs in the legacy shape (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, tokenizer: Any) -> None:
        super().__init__(request_id, model, tokenizer)
        self._offset = 0  # characters of token text rendered so far (text_offset of the next token)

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any token (none for completions)."""
        return []

    def chunk(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        """One streamed chunk (also the shape of the final body's single choice); ``token_ids`` only without a
        tokenizer."""
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        if self.tokenizer is None:
            choice["token_ids"] = list(token_ids)
        return {**self._head(self.chunk_object), "choices": [choice]}

    def final(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
        counts: dict[str, int],
    ) -> dict[str, Any]:
        """The non-streamed body."""
        return {**self.chunk(text, token_ids, logprobs, finish_reason), "usage": counts}

    def logprobs(self, logprobs: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        """Legacy logprobs of these tokens, or None when the request did not ask for them."""
        if logprobs is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


class ChatFormat(_Format):
    """``/v1/chat/completions`` bodies; logprobs as ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    chunk_object = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The first streamed chunk announces the assistant role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self._head(self.chunk_object), "choices": [choice]}]

    def chunk(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        """One streamed chunk: a content delta (empty on the last one when it carries no text). Chat always has a
        tokenizer (its template), so ``token_ids`` is not sent."""
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._head(self.chunk_object), "choices": [choice]}

    def final(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
        counts: dict[str, int],
    ) -> dict[str, Any]:
        """The non-streamed body."""
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": counts}

    def logprobs(self, logprobs: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        """Chat logprobs of these tokens, or None when the request did not ask for them."""
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            top = [self._entry(t, v) for t, v in lp.top]
            content.append({**self._entry(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
