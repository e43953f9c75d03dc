"""A tiny byte-level BPE tokenizer assembled in code, for tests and examples that must not download anything.

Vocabulary layout (ids are dense and all < vocab_size, so a tiny random model with vocab 256 can use it):

    0 <s>   1 </s>   2 <pad>                       special tokens (bos, eos, pad)
    3 .. 245                                        the 243 bytes that can occur in valid UTF-8, in byte order
    246 .. vocab_size - 1                           BPE merges learned from a small built-in English corpus

The 13 bytes that never occur in valid UTF-8 (0xC0, 0xC1, 0xF5..0xFF) have no token, which is what lets
every string be encoded with only 256 ids. Merges are learned by a deterministic pure-Python BPE (most frequent
pair, ties broken by the pair's text), so the same vocab_size always gives the same tokenizer. When the corpus runs
out of pairs the vocabulary is smaller than vocab_size, never larger.
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
INVALID_UTF8_BYTES = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 - len(INVALID_UTF8_BYTES)

# Each message is "<s>role\ncontent</s>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model reads tokens and predicts the next one.
Inference engines schedule requests, page the key and value cache into blocks, and sample tokens in batches.
In the beginning there was the word, and the word was split into bytes, and the bytes were merged into tokens.
She said that they would meet at the station in the evening, and then they went to the theatre together.
This is a test of the tokenizer: numbers like 12345 and 2024, punctuation, and repeated words words words.
The engine is pure: the scheduler returns a new state and a plan, and the executor applies the plan.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def _base_vocab() -> dict[str, int]:
    """Special tokens then every byte that may occur in valid UTF-8, as ByteLevel characters."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    byte_chars = _bytes_to_unicode()
    for b in range(256):
        if b not in INVALID_UTF8_BYTES:
            vocab[byte_chars[b]] = len(vocab)
    return vocab


def _count_pairs(words: dict[tuple[str, ...], int]) -> collections.Counter[tuple[str, str]]:
    """Occurrences of each adjacent symbol pair, weighted by word frequency."""
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    for word, freq in words.items():
        for pair in itertools.pairwise(word):
            pairs[pair] += freq
    return pairs


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """The word with every occurrence of `pair` fused into one symbol (left to right)."""
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    """Up to `num_merges` BPE merges learned from the built-in corpus, deterministically."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    counts = collections.Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
    words = {tuple(piece): freq for piece, freq in counts.items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs = _count_pairs(words)
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        words = {_merge_word(w, best): f for w, f in words.items()}
    return merges


def _build_backend(vocab_size: int) -> Tokenizer:
    """The `tokenizers` object: byte-level BPE, BOS prepended on encode, special tokens registered."""
    vocab = _base_vocab()
    merges = _learn_merges(vocab_size - len(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_test_tokenizer(path: str | Path | None = None, vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with ids < vocab_size, bos/eos/pad and a chat template.

    When `path` is given the tokenizer is also saved there, so `AutoTokenizer.from_pretrained(path)` loads it.
    Raises ValueError when vocab_size is below MIN_VOCAB_SIZE (246: 3 special tokens + 243 bytes).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (special tokens + bytes), got {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_build_backend(vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if path is not None:
        tokenizer.save_pretrained(str(path))
    return tokenizer
