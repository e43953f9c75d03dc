"""The text side of the engine: local tokenizer loading, each request's incremental detokenizer and chat
templating, defined once for every front end (``LLM``, the server, the CLI). It holds no model or device state,
so the server's web process uses it without building an executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.model.config import CheckpointError
from fnvllm.state import InvalidRequestError, SamplingParams
from fnvllm.state.checks import show

# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone does not: transformers then builds a
# placeholder tokenizer from the model type, with the wrong EOS id).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

Conversation = Sequence[Mapping[str, Any]]


def detokenizer_for(
    tokenizer: Any | None, prompt_ids: tuple[int, ...], params: SamplingParams
) -> IncrementalDetokenizer | None:
    """The incremental detokenizer of one request under ``tokenizer`` (None without one); raises as
    ``check_stop_strings`` does."""
    check_stop_strings(tokenizer, params)
    if tokenizer is None:
        return None
    stop, include, skip = params.stop, params.include_stop_str_in_output, params.skip_special_tokens
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip, stop, include, min_tokens=params.min_tokens)


def check_stop_strings(tokenizer: Any | None, params: SamplingParams) -> None:
    """Stop strings without a tokenizer are an InvalidRequestError naming ``SamplingParams.stop``: there is no
    text to find them in."""
    if tokenizer is None and params.stop:
        raise InvalidRequestError(
            "SamplingParams.stop: stop strings need a tokenizer (there is no text without one); "
            f"use stop_token_ids, got {params.stop!r}"
        )


def resolve_bad_words(tokenizer: Any | None, params: SamplingParams) -> SamplingParams:
    """``params`` with its ``bad_words`` text turned into ``bad_words_token_ids`` (after any given there) and
    cleared: what the core reads (it refuses the text). The one rule of every front end (``LLM``, the server).

    Each word, leading spaces stripped, is encoded twice without special tokens (vLLM's rule): alone, and after a
    space, since most tokenizers spell a word inside text with its space ("Paris" vs " Paris"). The spaced
    encoding is kept too when it starts with another token and has as many. A sequence already listed is not
    repeated. ``params`` itself is returned when it has no bad_words; InvalidRequestError naming the field when it
    has some and ``tokenizer`` is None, or when a word encodes to no tokens.
    """
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise InvalidRequestError(
            "SamplingParams.bad_words: words need a tokenizer (this engine has none: load_tokenizer=False); "
            f"give their ids as bad_words_token_ids, got {params.bad_words!r}"
        )
    words = list(params.bad_words_token_ids)
    for word in params.bad_words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not alone:  # only spaces: the spaced encoding is the word
            variants = (spaced,)
        elif spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            variants = (alone, spaced)
        else:
            variants = (alone,)
        if not any(variants):
            raise InvalidRequestError(f"SamplingParams.bad_words: {word!r} encodes to no tokens")
        words += [ids for ids in variants if ids and ids not in words]
    return attrs.evolve(params, bad_words=(), bad_words_token_ids=words)


DetokenizerFactory = Callable[[tuple[int, ...], SamplingParams], IncrementalDetokenizer | None]


def detokenizer_factory(tokenizer: Any | None) -> DetokenizerFactory:
    """``detokenizer_for`` bound to ``tokenizer`` (what the server's ``EngineWorker``, which holds no EngineParts,
    is given)."""
    return lambda prompt_ids, params: detokenizer_for(tokenizer, prompt_ids, params)


def render_chat(tokenizer: Any, conversation: Conversation, **template_kwargs: Any) -> str:
    """The conversation rendered by the tokenizer's chat template with the assistant's turn opened (unless
    ``template_kwargs`` say otherwise: ``add_generation_prompt=False``, or ``continue_final_message=True`` to
    continue the last assistant message, which opens no new turn).

    Raises InvalidRequestError naming ``messages`` when the template fails (jinja2 errors, a role order the
    template refuses, a tokenizer without a template: all come from the input)."""
    try:
        opens_turn = not template_kwargs.get("continue_final_message", False)
        options = {"add_generation_prompt": opens_turn, **template_kwargs}
        text = tokenizer.apply_chat_template([dict(m) for m in conversation], tokenize=False, **options)
    except Exception as e:
        raise InvalidRequestError(f"messages: the chat template failed: {e}") from None
    if not isinstance(text, str):
        raise InvalidRequestError(f"messages: the chat template returned {show(text)}, not text")
    return text


class MissingTokenizerError(CheckpointError):
    """A tokenizer folder that holds no tokenizer vocabulary (none of TOKENIZER_FILES); ``folder`` is it."""

    def __init__(self, folder: Path) -> None:
        super().__init__(
            f"{folder} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); pass tokenizer=FOLDER, "
            "or load_tokenizer=False to use token-id prompts only"
        )
        self.folder = folder


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer vocabulary (one of TOKENIZER_FILES)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_local_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``, never from the network: a folder that does not exist, or holds no
    tokenizer vocabulary (see TOKENIZER_FILES), is a clear error instead of a hub lookup (which retries for a
    minute offline) or a placeholder tokenizer (which transformers builds from the model type, EOS id and all).
    Pass ``load_tokenizer=False`` for token-id-only use."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder {str(folder)!r} does not exist (tokenizers load only from local folders)"
        )
    if not has_tokenizer_files(folder):
        raise MissingTokenizerError(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, its own) for broken files
        raise CheckpointError(f"{folder}: the tokenizer cannot be loaded ({type(e).__name__}: {e})") from None
