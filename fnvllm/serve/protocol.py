"""Request bodies of the OpenAI API subset we serve, as pydantic models that forbid unknown fields.

Supported OpenAI fields: model, temperature, top_p, max_tokens (chat also max_completion_tokens), stop, seed,
n (1 only), logprobs (chat: logprobs + top_logprobs), presence_penalty, frequency_penalty, stream,
stream_options.include_usage, user. Extensions (as in vLLM): top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, include_stop_str_in_output. A few OpenAI fields are accepted only at their neutral value (echo
false, best_of 1, empty logit_bias, no suffix); anything else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from fnvllm.serve.errors import bad_request
from fnvllm.state import SamplingParams

Number = StrictInt | StrictFloat  # JSON numbers only: no bools, no numeric strings


def _encodable(text: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON ``"\\ud800"`` without its pair) cannot be encoded,
    tokenized or detokenized, so it is refused here, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"holds a lone surrogate at character {error.start}; send a valid UTF-16 pair") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]
"""A string a tokenizer can take: no lone surrogates."""


class _Strict(BaseModel):
    """A body that rejects fields it does not declare."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: include_usage adds a last chunk with the token counts (and empty choices)."""

    include_usage: StrictBool = False


_SAMPLING_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
    "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output",
)  # fmt: skip
"""Body fields passed to SamplingParams under the same name (max_tokens and logprobs need translating)."""


class _Generation(_Strict):
    """Fields shared by completions and chat completions (None = the engine's default)."""

    model: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    max_tokens: StrictInt | None = None
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None

    def check_supported(self) -> None:
        """Raise a 400 for fields we accept only at their neutral value."""
        if self.n not in (None, 1):
            raise bad_request(f"n: only n=1 is supported, got {self.n}", "n")
        if self.logit_bias:
            raise bad_request("logit_bias: not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (unset ones keep the engine's defaults)."""
        return {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}

    def aliases(self) -> dict[str, str]:
        """Engine field name -> the body field it came from, where the two differ (so a 400 names what was sent)."""
        return {}

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[StrictInt]


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt, as text or token ids (a one-element batch is accepted)."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        """Raise a 400 for unsupported values (batches, echo, best_of > 1, suffix)."""
        super().check_supported()
        if self._is_batch() and len(self.prompt) != 1:
            raise bad_request("prompt: send one prompt per request (batches are not supported)", "prompt")
        for name, neutral in (("echo", False), ("best_of", 1), ("suffix", None)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise bad_request(f"{name}: not supported (got {value!r})", name)

    def _is_batch(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], (str, list))

    def single_prompt(self) -> str | list[int]:
        """The prompt, unwrapped from a one-element batch."""
        return self.prompt[0] if self._is_batch() else self.prompt  # type: ignore[return-value]

    def sampling_params(self) -> SamplingParams:
        """SamplingParams for this body (OpenAI's default max_tokens for completions is 16)."""
        kwargs = self.sampling_kwargs()
        kwargs["max_tokens"] = 16 if self.max_tokens is None else self.max_tokens
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        return SamplingParams(**kwargs)


class TextPart(_Strict):
    """One text part of a message's content list (images and audio are not supported)."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One message of a conversation; its content (required: a message without one is a 400) goes through the
    tokenizer's chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart]
    name: StrictStr | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template reads it (text parts joined)."""
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content
        message = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: a conversation rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        """Raise a 400 for top_logprobs without logprobs."""
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    def aliases(self) -> dict[str, str]:
        """``max_completion_tokens`` and ``top_logprobs`` reach the engine as max_tokens and logprobs."""
        names = {}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        if self.top_logprobs is not None:
            names["logprobs"] = "top_logprobs"
        return names

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this body; without a limit, generate up to ``default_max_tokens``."""
        kwargs = self.sampling_kwargs()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kwargs["max_tokens"] = default_max_tokens if limit is None else limit
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kwargs)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for model in models for name in model.model_fields)


FIELD_NAMES = _field_names(CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
"""Every field name of the request bodies (error locations are cut at the first part that is not one)."""
