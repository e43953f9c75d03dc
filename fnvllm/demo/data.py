"""The demo model's data recipe: Python's own standard library, split by file, and a byte-level BPE tokenizer.

Every machine that runs fnvllm has this corpus: the ``*.py`` files under the folder of the ``os`` module
(``Path(inspect.getfile(os)).parent``), its subpackages included, except the test suites, installed third-party
packages, and two data-like packages whose files are tables or prose rather than code (``encodings``' codec tables
and ``pydoc_data``' help topics): ``EXCLUDED_DIRS``. The sorted file list is shuffled with ``random.Random(seed)``;
the first ``HELD_OUT_FRACTION`` of it is held out (validation), the rest trains both the tokenizer and the model.
Documents are joined with the EOS token, so the model learns where a file ends.

The tokenizer is trained on the training files only, with the ``tokenizers`` library: GPT-2-style byte-level BPE
(every byte has a token, so any text encodes), no BOS, ``<|endoftext|>`` as EOS and pad.
"""

from __future__ import annotations

import inspect
import os
import random
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
HELD_OUT_FRACTION = 0.1
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)

# A code model's "chat": the conversation becomes a Python file. User and system turns are `#` comments, the
# assistant's turns are code, and the generation prompt is a blank line after the last comment.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + '\n' }}"
    "{% else %}{{ '# ' + message['content'] | replace('\n', '\n# ') + '\n' }}{% endif %}"
    "{% endfor %}"
)


def stdlib_dir() -> Path:
    """The folder of this Python's standard library (where ``os.py`` lives)."""
    return Path(inspect.getfile(os)).parent


def corpus_files(root: Path | None = None) -> list[Path]:
    """The corpus: ``*.py`` under ``root`` (default: the stdlib) outside ``EXCLUDED_DIRS``, sorted by path."""
    root = root or stdlib_dir()
    files = (f for f in root.rglob("*.py") if not EXCLUDED_DIRS & set(f.relative_to(root).parts[:-1]))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def split_files(seed: int, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held_out): the corpus files of ``root`` (default: the stdlib), shuffled by ``seed``, split."""
    files = corpus_files(root)
    random.Random(seed).shuffle(files)
    num_held_out = max(1, round(len(files) * HELD_OUT_FRACTION))
    return files[num_held_out:], files[:num_held_out]


def read_texts(files: Sequence[Path]) -> list[str]:
    """Each file's text (UTF-8; the rare undecodable byte becomes U+FFFD)."""
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``vocab_size`` ids learned from ``texts``, with EOS and the chat template.

    It sets no ``model_max_length``: the engine's ``max_model_len`` (the checkpoint's max_position_embeddings)
    bounds a request, with a clear error, and a second limit here would only add a warning to that error."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[int]:
    """All documents' token ids, each followed by EOS, concatenated into one stream."""
    eos = int(tokenizer.eos_token_id)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.backend_tokenizer.encode(text).ids)
        ids.append(eos)
    return ids


def copy_corpus(dest: Path, root: Path | None = None) -> int:
    """Copy the corpus files of ``root`` (default: the stdlib) under ``dest``, keeping their relative paths, so a
    machine with another Python can train on this one's corpus (``train --corpus-dir dest``); returns the count."""
    root = root or stdlib_dir()
    files = corpus_files(root)
    for file in files:
        target = dest / file.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target)
    return len(files)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fnvllm.demo.data DEST  (copies this Python's corpus to DEST)")
    print(f"copied {copy_corpus(Path(sys.argv[1]))} files to {sys.argv[1]}")
