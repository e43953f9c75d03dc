"""Tests of the built-in byte-level test tokenizer (fnvllm/testing/tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fnvllm.testing.tokenizer import MIN_VOCAB_SIZE, build_test_tokenizer

TEXT = "Hello the world, héllo 你好 🙂\n\tend"


def test_ids_fit_vocab_and_round_trip() -> None:
    """Every id is < vocab_size, BOS is prepended, and decoding gives the text back."""
    tokenizer = build_test_tokenizer(None, vocab_size=256)
    ids = tokenizer(TEXT)["input_ids"]
    assert len(tokenizer) == 256 and max(ids) < 256
    assert ids[0] == tokenizer.bos_token_id == 0
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2)
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_larger_vocab_is_deterministic_and_bounded() -> None:
    """A larger vocab_size adds merges deterministically and never exceeds the requested size."""
    first, second = build_test_tokenizer(None, vocab_size=300), build_test_tokenizer(None, vocab_size=300)
    assert first.get_vocab() == second.get_vocab()
    assert len(first) <= 300 and max(first(TEXT)["input_ids"]) < 300


def test_saved_folder_loads_with_auto_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """The saved folder loads with AutoTokenizer and its chat template renders a generation prompt."""
    build_test_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("hi")["input_ids"] == build_test_tokenizer(None)("hi")["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>user\nhi</s>\n<s>assistant\n"


def test_too_small_vocab_is_rejected() -> None:
    """A vocab_size below the 246 special + byte tokens raises a ValueError naming the field."""
    with pytest.raises(ValueError, match="vocab_size must be >= 246"):
        build_test_tokenizer(None, vocab_size=MIN_VOCAB_SIZE - 1)
