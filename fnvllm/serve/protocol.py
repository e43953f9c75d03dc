"""Request bodies of the OpenAI API subset we serve, as pydantic models that forbid unknown fields.

Three kinds of fields (docs/serving.md lists them all):

- acted on: model, messages / prompt (text, ids, or a batch of either), temperature, top_p, max_tokens (or its newer
  name max_completion_tokens), stop, seed, n, best_of, echo, logprobs (chat: logprobs + top_logprobs),
  presence_penalty, frequency_penalty, stream, stream_options (include_usage, continuous_usage_stats); the vLLM
  extensions top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output;
- accepted and ignored, because they change nothing this server answers (``IGNORED_FIELDS``): user, store,
  metadata, service_tier, reasoning_effort, prompt_cache_key, safety_identifier, stream_options.include_obfuscation,
  parallel_tool_calls (without tools), tool_choice "none" (without tools), response_format {"type": "text"};
- refused by name with a 400, because they would change the answer and are not supported: logit_bias, suffix,
  tools, response_format json_object / json_schema, echo together with logprobs, and every field not declared
  here.
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


MAX_N = 128
"""The most choices (``n``, and ``best_of`` candidates) one prompt may ask for."""
MAX_SEQUENCES = 1024
"""The most engine requests one HTTP request may start (prompts x best_of)."""

IGNORED_FIELDS = (
    "user", "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
    "parallel_tool_calls", "stream_options.include_obfuscation",
)  # fmt: skip
"""Fields accepted (type-checked) and then ignored: none of them changes what this server generates. Also accepted
only at a neutral value: ``tool_choice`` "none"/"auto" and an empty ``tools`` list, ``response_format``
{"type": "text"}, an empty ``suffix``, an empty ``logit_bias``."""


class StreamOptions(_Strict):
    """``stream_options``: include_usage adds a last chunk with the token counts (and empty choices);
    continuous_usage_stats puts the counts so far in every chunk; include_obfuscation is ignored (there is no
    padding to add on a local server)."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = None


class ResponseFormat(_Strict):
    """``response_format``: only {"type": "text"} (plain text, the default) is served; the structured types are
    refused by name."""

    type: StrictStr
    json_schema: dict[str, Any] | None = None


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
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name; wins over max_tokens when both are sent
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
    # accepted and ignored (IGNORED_FIELDS), or accepted only at a neutral value
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        """Raise a 400 naming a field that would change the answer and is not supported (or is out of range)."""
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"n: must be in [1, {MAX_N}], got {self.n}", "n")
        if self.logit_bias:
            raise bad_request("logit_bias: not supported (the sampler runs on the device, per row)", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        if self.tools:
            raise bad_request("tools: tool calling is not supported by this server", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request(
                f"tool_choice: only 'none' or 'auto' without tools, got {self.tool_choice!r}", "tool_choice"
            )
        if self.response_format is not None and self.response_format.type != "text":
            kind = self.response_format.type
            raise bad_request(f"response_format: only type 'text' is supported, got {kind!r}", "response_format")

    @property
    def num_choices(self) -> int:
        """``n``: choices returned per prompt."""
        return self.n or 1

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the token counts so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (unset ones keep the engine's defaults)."""
        return {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}

    def aliases(self) -> dict[str, str]:
        """Engine field name -> the body field it came from, where the two differ (so a 400 names what was sent)."""
        return {"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {}

    @property
    def token_limit(self) -> int | None:
        """The output limit sent: ``max_completion_tokens``, else ``max_tokens`` (None: not sent)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[StrictInt]


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt or a batch, each as text or token ids."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        """Raise a 400 for unsupported values (suffix, echo with logprobs, best_of out of range, an empty batch,
        too many sequences)."""
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix: not supported (this server has no fill-in-the-middle format)", "suffix")
        if self.echo and self.logprobs is not None:
            message = "echo: not supported together with logprobs (this server computes no prompt logprobs)"
            raise bad_request(message, "echo")
        if self.best_of is not None and not self.num_choices <= self.best_of <= MAX_N:
            raise bad_request(f"best_of: must be in [n, {MAX_N}] (n={self.num_choices}), got {self.best_of}", "best_of")
        if self.stream and self.num_candidates > self.num_choices:
            raise bad_request("best_of: must equal n when stream is true (candidates are ranked at the end)", "best_of")
        if self._is_batch() and not self.prompt:
            raise bad_request("prompt: an empty batch", "prompt")
        num = len(self.prompts()) * self.num_candidates
        if num > MAX_SEQUENCES:
            raise bad_request(f"prompt: prompts x best_of is {num}; at most {MAX_SEQUENCES} per request", "prompt")

    @property
    def num_candidates(self) -> int:
        """``best_of``: sequences generated per prompt (the best ``n`` are returned)."""
        return self.best_of or self.num_choices

    def _is_batch(self) -> bool:
        prompt = self.prompt
        return isinstance(prompt, list) and (not prompt or isinstance(prompt[0], (str, list)))

    def prompts(self) -> list[str | list[int]]:
        """The prompts, a single one as a batch of one."""
        return list(self.prompt) if self._is_batch() else [self.prompt]  # type: ignore[list-item]

    def sampling_params(self) -> SamplingParams:
        """SamplingParams for this body (OpenAI's default max_tokens for completions is 16). With best_of > n
        the chosen tokens' logprobs are asked for too (they rank the candidates)."""
        kwargs = self.sampling_kwargs()
        kwargs["max_tokens"] = 16 if self.token_limit is None else self.token_limit
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        elif self.num_candidates > self.num_choices:
            kwargs["logprobs"] = 0
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
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        """Raise a 400 for top_logprobs without logprobs."""
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    def aliases(self) -> dict[str, str]:
        """``max_completion_tokens`` and ``top_logprobs`` reach the engine as max_tokens and logprobs."""
        names = super().aliases()
        if self.top_logprobs is not None:
            names["logprobs"] = "top_logprobs"
        return names

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this body; without a limit, generate up to ``default_max_tokens``."""
        kwargs = self.sampling_kwargs()
        limit = self.token_limit
        kwargs["max_tokens"] = default_max_tokens if limit is None else limit
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kwargs)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for model in models for name in model.model_fields)


FIELD_NAMES = _field_names(
    CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat
)
"""Every field name of the request bodies (error locations are cut at the first part that is not one)."""
