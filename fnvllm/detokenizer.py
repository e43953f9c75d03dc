"""Incremental detokenization for streaming, with stop strings.

Decoding token by token is wrong in two ways: a multi-byte character split across tokens decodes to '\\ufffd'
pieces, and tokenizers that drop a word's leading space at the start of a decode (SentencePiece) lose spaces.
We use vLLM's prefix-offset / read-offset scheme instead. Keep all ids seen (a few prompt ids for context,
then the output) and two offsets into them:

    ids:    [ ... p  p  p  p  p | o  o  o | o  o ]
                  ^prefix_offset  ^read_offset  ^end
    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted (or prompt context)
    full_text   = decode(ids[prefix_offset:])
    new text    = full_text[len(prefix_text):]

New text is released only when `full_text` does not end in '\\ufffd' (an incomplete character waits
for its next bytes); then prefix_offset <- read_offset and read_offset <- end. Decoding a short window each step costs
O(new tokens), not O(output length).

Stop strings are searched in the decoded text from a little before the new text, so a stop string spanning
several tokens is found. While none has matched, the last (longest stop string - 1) characters are held back
from the stream (they may start a stop string) unless include_stop_str_in_output; `finish()` releases them,
and any incomplete-character tail, when the sequence ends for another reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_PROMPT_TOKENS = 5


class Decoder(Protocol):
    """Anything with HF's `decode(ids, skip_special_tokens=...)`: PreTrainedTokenizerBase, tokenizers.Tokenizer."""

    def decode(self, ids: Any, skip_special_tokens: bool = ...) -> str:
        """Text of `ids`."""
        ...


@attrs.frozen
class DetokDelta:
    """What one `add` (or `finish`) released: text to append to the stream, and whether a stop string hit."""

    new_text: str
    stopped: bool


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in text[start:], ties going to the first listed."""
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None


class IncrementalDetokenizer:
    """Turns one sequence's output ids, arriving a few at a time, into streamed text; applies stop strings.

    `text` is all output text decoded so far (truncated at a stop string once one hits), including
    characters held back from the stream; the concatenated `new_text` of every `add` plus `finish` equals
    `text`. Without a stop hit, `text` after `finish()` equals `tokenizer.decode(output_ids,
    skip_special_tokens=...)` for tokenizers whose decode is a concatenation of token pieces (byte-level BPE;
    SentencePiece may differ in the first character, where the prompt context restores a leading space that a
    standalone decode drops).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """Prime the window with the prompt's last few ids (context only; their text is never emitted).
        ``min_tokens``: stop strings are looked for only in text that ids past the first ``min_tokens`` add (a
        match must end there; it may start earlier), as vLLM does."""
        if any(s == "" for s in stop):
            raise ValueError(f"stop must contain non-empty strings, got {stop!r}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold_back = 0 if include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1
        context = list(prompt_ids[-NUM_CONTEXT_PROMPT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt ending mid-character would make its own text change; decode without it
        self._ids: list[int] = context
        self._stops_from = len(context) + min_tokens  # stop strings count once self._ids is longer than this
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._num_emitted = 0
        self._stopped = False

    @property
    def text(self) -> str:
        """Output text decoded so far; ends before a stop string that hit (or after it, when asked)."""
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched; further ids are ignored."""
        return self._stopped

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self, allow_incomplete: bool) -> str:
        """Text of the ids past read_offset, and advance the offsets; '' while a character is incomplete."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _apply_stop(self, search_from: int) -> None:
        """Truncate `text` at the earliest stop string starting at or after `search_from`, if any."""
        hit = _find_stop(self._text, self._stop, search_from)
        if hit is not None:
            index, stop = hit
            self._text = self._text[: index + len(stop) if self._include_stop else index]
            self._stopped = True

    def _release(self, hold_back: int) -> DetokDelta:
        """Emit the text not yet streamed, minus the last `hold_back` characters unless stopped."""
        end = len(self._text) if self._stopped else max(self._num_emitted, len(self._text) - hold_back)
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return DetokDelta(new_text=delta, stopped=self._stopped)

    def _extend(self, new_text: str) -> None:
        """Append decoded text and look for a stop string overlapping it."""
        old_len = len(self._text)
        self._text += new_text
        if self._stop and new_text and len(self._ids) > self._stops_from:
            self._apply_stop(max(0, old_len - max(len(s) for s in self._stop) + 1))

    def add(self, new_token_ids: Iterable[int]) -> DetokDelta:
        """Feed newly generated ids; returns the text safe to stream now and whether a stop string hit."""
        if self._stopped:
            return DetokDelta(new_text="", stopped=True)
        self._ids.extend(new_token_ids)
        self._extend(self._decode_window(allow_incomplete=False))
        return self._release(self._hold_back)

    def finish(self) -> DetokDelta:
        """Flush at the end of the sequence: held-back text and an incomplete tail (as '\\ufffd')."""
        if not self._stopped:
            self._extend(self._decode_window(allow_incomplete=True))
        return self._release(hold_back=0)
