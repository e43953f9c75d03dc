"""Tests of incremental detokenization and stop strings (fnvllm/detokenizer.py) on the test tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from fnvllm.detokenizer import DetokDelta, IncrementalDetokenizer
from fnvllm.testing.tokenizer import build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """The 256-id byte-level test tokenizer, built once for the module."""
    return build_test_tokenizer(None)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[DetokDelta]:
    """Feed `ids` in random chunks of 1-4, stopping early when a stop string hits; then finish."""
    deltas, i = [], 0
    while i < len(ids) and not detok.stopped:
        step = rng.randint(1, 4)
        deltas.append(detok.add(ids[i : i + step]))
        i += step
    deltas.append(detok.finish())
    return deltas


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of `text` without the BOS the tokenizer prepends."""
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_text_equals_full_decode_on_random_ids(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """On random id streams (special tokens, broken UTF-8), the streamed text equals decode(ids)."""
    rng = random.Random(seed)
    prompt = _encode(tokenizer, "Some prompt text, ünïcode ✓")
    if seed % 2:  # a random prompt may end in the middle of a character
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 80))]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    streamed = "".join(d.new_text for d in _stream(detok, ids, rng))
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed == expected
    assert detok.text == expected


@pytest.mark.parametrize("seed", range(10))
def test_valid_text_streams_without_replacement_chars(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """Multi-byte characters split across tokens are never streamed as '\\ufffd' pieces."""
    rng = random.Random(seed)
    alphabet = "aé你🙂 ßж€\n"
    text = "".join(rng.choice(alphabet) for _ in range(40))
    ids = _encode(tokenizer, text)
    assert len(ids) > len(text)  # some characters really are split over several byte tokens
    deltas = _stream(IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id]), ids, rng)
    assert all("\ufffd" not in d.new_text for d in deltas)
    assert "".join(d.new_text for d in deltas) == text


def test_multibyte_char_is_released_whole(tokenizer: PreTrainedTokenizerFast) -> None:
    """The four byte tokens of an emoji release nothing until the last one, then the whole character."""
    ids = _encode(tokenizer, "🙂")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([i]).new_text for i in ids] == ["", "", "", "🙂"]


def test_special_tokens_kept_when_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    """With skip_special_tokens=False the special tokens' text is streamed too."""
    ids = [*_encode(tokenizer, "hi"), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    detok.add(ids)
    assert detok.text == "hi</s>"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_stop_string_spanning_tokens_truncates(tokenizer: PreTrainedTokenizerFast, include: bool, seed: int) -> None:
    """A stop string spanning several tokens ends the text before it (or after it when included)."""
    text = "Hello world. The end is near, the end."
    detok = IncrementalDetokenizer(tokenizer, [], stop=("xyz", "end is"), include_stop_str_in_output=include)
    deltas = _stream(detok, _encode(tokenizer, text), random.Random(seed))
    expected = "Hello world. The end is" if include else "Hello world. The "
    assert detok.text == expected
    assert detok.stopped and deltas[-1].stopped
    assert "".join(d.new_text for d in deltas) == expected


def test_partial_stop_string_is_held_back(tokenizer: PreTrainedTokenizerFast) -> None:
    """Text that might begin a stop string is not streamed until it is known not to be one."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=("abc",))
    assert detok.add(_encode(tokenizer, "xxab")) == DetokDelta(new_text="xx", stopped=False)
    assert detok.add(_encode(tokenizer, "d")) == DetokDelta(new_text="a", stopped=False)
    assert detok.finish() == DetokDelta(new_text="bd", stopped=False)
    assert detok.text == "xxabd"


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    """When several stop strings match, the text ends at the one that starts first."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=("world", "lo w"))
    delta = detok.add(_encode(tokenizer, "hello world"))
    assert delta == DetokDelta(new_text="hel", stopped=True)
    assert detok.add(_encode(tokenizer, "more")) == DetokDelta(new_text="", stopped=True)


def test_raw_tokenizers_object_is_accepted(tokenizer: PreTrainedTokenizerFast) -> None:
    """A bare tokenizers.Tokenizer works as well as the transformers wrapper."""
    ids = _encode(tokenizer, "naïve café ✓")
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [])
    for i in ids:
        detok.add([i])
    detok.finish()
    assert detok.text == "naïve café ✓"
