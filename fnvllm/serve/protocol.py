"""Request bodies of the OpenAI API subset we serve, as pydantic models that forbid unknown fields.

Three kinds of fields (docs/serving.md lists them all):

- acted on: model, messages / prompt (text, ids, or a batch of either), temperature, top_p, max_tokens (or its newer
  name max_completion_tokens), stop, seed, n, best_of, echo, logprobs (chat: logprobs + top_logprobs),
  presence_penalty, frequency_penalty, stream, stream_options (include_usage, continuous_usage_stats),
  response_format (text, json_object, json_schema); chat: tools, tool_choice, parallel_tool_calls, assistant
  messages holding tool_calls and tool messages; the vLLM extensions top_k, min_p, repetition_penalty, ignore_eos,
  min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens,
  allowed_token_ids, bad_words, guided_json, guided_regex, guided_choice, guided_grammar, include_reasoning
  (docs/structured_outputs.md), chat_template_kwargs (passed to the chat template, e.g. Qwen3's
  ``{"enable_thinking": false}``; not the arguments the server sets); logit_bias (token-id strings -> bias in
  [-100, 100]); use_beam_search with length_penalty (``fnvllm.serve.beam``; what it refuses: ``BEAM_REFUSED``);
  completions: echo with logprobs (the prompt's tokens and their logprobs first), max_tokens 0 with echo (score
  a prompt: nothing is generated);
- accepted and ignored, because they change nothing this server answers (``IGNORED_FIELDS``): user, store,
  metadata, service_tier, reasoning_effort, prompt_cache_key, safety_identifier, stream_options.include_obfuscation,
  guided_decoding_backend, parallel_tool_calls (without tools), tool_choice "none" (without tools);
- refused by name with a 400, because they would change the answer and are not supported: suffix, tools in
  completions, max_tokens 0 without echo or when streamed, with use_beam_search the fields it cannot honour
  (``BEAM_REFUSED``), and every field not declared here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from fnvllm.serve.errors import bad_request
from fnvllm.serve.tool_parsers import HermesToolParser, ToolCallParser, ToolSpec
from fnvllm.state import InvalidRequestError, SamplingParams, StructuredOutput
from fnvllm.state.params import MAX_N

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


MAX_SEQUENCES = 1024
"""The most engine requests one HTTP request may start (prompts x best_of)."""

IGNORED_FIELDS = (
    "user", "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
    "parallel_tool_calls", "stream_options.include_obfuscation", "guided_decoding_backend",
)  # fmt: skip
"""Fields accepted (type-checked) and then ignored: none of them changes what this server generates
(``parallel_tool_calls`` does with tools in chat). Also accepted only at a neutral value: ``tool_choice``
"none"/"auto" and an empty ``tools`` list in completions, an empty ``suffix``."""


class StreamOptions(_Strict):
    """``stream_options``: include_usage adds a last chunk with the token counts (and empty choices);
    continuous_usage_stats puts the counts so far in every chunk; include_obfuscation is ignored (there is no
    padding to add on a local server)."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = None


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema (``schema``), its name and description, and ``strict`` (the
    schema is always enforced by the grammar mask, strict or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """``response_format``: {"type": "text"} (the default), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""Body fields that constrain the output (at most one per request; tool_choice "required" or a named function is
a constraint too)."""


def compiled(spec: StructuredOutput, field: str) -> StructuredOutput:
    """``spec`` once its grammar compiles, else a 400 naming ``field`` (a bad regex, EBNF or schema), or a 400
    saying xgrammar is missing."""
    from fnvllm.executor.structured import check_structured

    try:
        check_structured(SamplingParams(structured=spec))
    except InvalidRequestError as error:
        message = str(error).removeprefix("SamplingParams.structured")
        raise bad_request(f"{field}: {message.lstrip(' :')}", field) from None
    return spec


def _structured_from(field: str, value: Any) -> StructuredOutput:
    """The StructuredOutput of one guided field's value (validated: its text, then its grammar)."""
    try:
        if field == "guided_json":
            spec = StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
        elif field == "guided_regex":
            spec = StructuredOutput.regex(value)
        elif field == "guided_choice":
            spec = StructuredOutput.choice(value)
        else:
            spec = StructuredOutput.grammar(value)
    except InvalidRequestError as error:
        raise bad_request(f"{field}: {str(error).removeprefix('SamplingParams.structured')}", field) from None
    return compiled(spec, field)


_SAMPLING_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
    "ignore_eos", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
)  # fmt: skip
"""Body fields passed to SamplingParams under the same name (max_tokens and logprobs need translating)."""

BEAM_REFUSED = (
    "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "stop", "stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias",
)  # fmt: skip
"""Body fields refused by name (when set) with ``use_beam_search``, as are an output constraint (GUIDED_FIELDS, a
forced tool call), ``best_of`` other than n and ``max_tokens`` 0: the search ranks whole beams by their raw
logprobs, so it cannot sample, filter, penalise, constrain or stop on text. Honoured: n (the beam width),
max_tokens, ignore_eos, temperature, length_penalty, include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens, echo, logprobs (chat: with top_logprobs), stream and stream_options (each choice one chunk
once the search is done: ``fnvllm.serve.beam``)."""


def _is_sent(value: Any) -> bool:
    """Whether a body field holds a value that asks for something: not None, false, [] or {} (0 does)."""
    return value is not None and value is not False and value != [] and value != {}


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
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = None  # the handlers cut the prompt (``state.params.truncate_prompt``)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[Text] | None = None  # the handlers resolve them to ids (``engine.text.resolve_bad_words``)
    use_beam_search: StrictBool | None = None  # n beams per prompt, the n best returned (``fnvllm.serve.beam``)
    length_penalty: Number | None = None  # beam search's score: cum_logprob / length ** length_penalty (default 1)
    # accepted and ignored (IGNORED_FIELDS), or accepted only at a neutral value
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictBool | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None

    def check_supported(self) -> None:
        """Raise a 400 naming a field that would change the answer and is not supported (or is out of range)."""
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"n: must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        sent = [name for name in GUIDED_FIELDS if self._constrains(name)]
        if len(sent) > 1:
            raise bad_request(f"{sent[1]}: only one output constraint per request, got {' and '.join(sent)}", sent[1])
        if self.use_beam_search:
            self._check_beam_search(sent)
        elif self.length_penalty is not None:
            raise bad_request("length_penalty: only used with use_beam_search: true", "length_penalty")

    def _check_beam_search(self, constraints: list[str]) -> None:
        """A 400 naming the first field sent that beam search cannot honour (``BEAM_REFUSED``, an output
        constraint)."""
        refused = [name for name in BEAM_REFUSED if _is_sent(getattr(self, name))] + constraints
        if refused:
            raise bad_request(f"{refused[0]}: not supported with use_beam_search", refused[0])

    def _constrains(self, name: str) -> bool:
        """Whether body field ``name`` (one of GUIDED_FIELDS) constrains the output."""
        if name == "response_format":
            return self.response_format is not None and self.response_format.type != "text"
        return getattr(self, name) is not None

    def structured(self) -> StructuredOutput | None:
        """The output constraint of this body (``response_format`` or a guided_* field), grammar checked; None
        when unconstrained. A 400 names the field when its schema, regex, choices or grammar is invalid."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return compiled(StructuredOutput.json_object(), "response_format")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                message = "response_format: type json_schema needs json_schema.schema"
                raise bad_request(message, "response_format")
            return compiled(StructuredOutput.json_schema(fmt.json_schema.schema_), "response_format")
        for name in GUIDED_FIELDS[1:]:
            value = getattr(self, name)
            if value is not None:
                return _structured_from(name, value)
        return None

    @property
    def num_choices(self) -> int:
        """``n``: choices returned per prompt."""
        return self.n or 1

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the token counts so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_kwargs(self, structured: StructuredOutput | None) -> dict[str, Any]:
        """The SamplingParams fields this body sets (unset ones keep the engine's defaults), with ``structured``,
        its output constraint (``structured()``'s)."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias:
            kwargs["logit_bias"] = self._logit_bias()
        if structured is not None:
            kwargs["structured"] = structured
        return kwargs

    def _logit_bias(self) -> dict[int, float]:
        """``logit_bias`` with its keys as token ids (a 400 names a key that is not a decimal id); the values'
        range and the ids' vocabulary are checked by the engine."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdecimal() or not key.isascii():
                raise bad_request(f"logit_bias: keys must be token ids (decimal strings), got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

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
        if self.tools:
            raise bad_request("tools: tool calling is served by /v1/chat/completions only", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            message = f"tool_choice: only 'none' or 'auto' without tools, got {self.tool_choice!r}"
            raise bad_request(message, "tool_choice")
        if self.suffix:
            raise bad_request("suffix: not supported (this server has no fill-in-the-middle format)", "suffix")
        limit_field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if self.scores_only and not self.echo:
            raise bad_request(f"{limit_field}: 0 is only allowed with echo (scoring a prompt)", limit_field)
        if self.use_beam_search and self.scores_only:
            raise bad_request(f"{limit_field}: 0 is not supported with use_beam_search", limit_field)
        if self.use_beam_search and self.num_candidates != self.num_choices:
            raise bad_request("best_of: not supported with use_beam_search (n is the beam width)", "best_of")
        if self.stream and self.scores_only:
            raise bad_request(f"stream: not supported with {limit_field} 0 (send stream: false)", "stream")
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
    def scores_only(self) -> bool:
        """``max_tokens`` 0: nothing is generated (with echo: the prompt, and with logprobs its scores)."""
        return self.token_limit == 0

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
        the chosen tokens' logprobs are asked for too (they rank the candidates). With echo and logprobs, the
        prompt's logprobs too (``prompt_logprobs``). max_tokens 0 (with echo) runs one token, which the answer
        drops: the engine always samples after the prompt."""
        kwargs = self.sampling_kwargs(self.structured())
        limit = self.token_limit
        kwargs["max_tokens"] = 16 if limit is None else 1 if limit == 0 else limit
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:
                kwargs["prompt_logprobs"] = self.logprobs
        elif self.num_candidates > self.num_choices:
            kwargs["logprobs"] = 0
        return SamplingParams(**kwargs)


class TextPart(_Strict):
    """One text part of a message's content list (images and audio are not supported)."""

    type: Literal["text"]
    text: Text


class CalledFunction(_Strict):
    """``tool_calls[i].function`` of an assistant message: the name and the arguments as JSON text."""

    name: StrictStr
    arguments: StrictStr


class AssistantToolCall(_Strict):
    """One call an assistant message made (sent back by the client with the conversation)."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object when they are JSON text of one."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        call: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(_Strict):
    """One message of a conversation; its content (required, except in an assistant message holding
    ``tool_calls``: a message without one is a 400) goes through the tokenizer's chat template. ``tool`` messages
    answer a call (``tool_call_id``); ``reasoning_content`` sent back by a client is not rendered."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (text parts joined)."""
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content or ""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# Arguments of ``apply_chat_template`` that the server sets itself (or that would make it return something other
# than the prompt's text): a request's chat_template_kwargs may not name them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


_HERMES = HermesToolParser()  # the server's default tool-call format (parsers hold no state)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: a conversation rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    include_reasoning: StrictBool | None = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None

    def check_supported(self) -> None:
        """Raise a 400 for top_logprobs without logprobs, a message without content, a tool_choice that is not
        "none", "auto", "required" or a function of ``tools``, or two output constraints."""
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                field = f"chat_template_kwargs.{key}"
                raise bad_request(f"{field}: set by the server (the request's own fields say it), not allowed", field)
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise bad_request(f"messages.{i}.content: required (except with tool_calls)", f"messages.{i}.content")
        self._check_tool_choice()

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str) or set(choice) - {"type", "function"}:
                message = 'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": '
                raise bad_request(message + f'{{"name": ...}}}}, got {choice!r}', "tool_choice")
            if name not in names:
                raise bad_request(f"tool_choice: function {name!r} is not in tools ({names})", "tool_choice")
        elif choice not in (None, "none", "auto", "required"):
            message = f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}'
            raise bad_request(message, "tool_choice")
        elif choice == "required" and not names:
            raise bad_request('tool_choice: "required" needs tools', "tool_choice")
        if self.forced_tool is not None and self.use_beam_search:
            raise bad_request("tool_choice: a forced tool call is not supported with use_beam_search", "tool_choice")
        if self.forced_tool is not None:
            other = next((name for name in GUIDED_FIELDS if self._constrains(name)), None)
            if other is not None:
                raise bad_request(f"{other}: not allowed together with tool_choice {self.tool_choice!r}", other)

    @property
    def forced_tool(self) -> str | None:
        """ "*" when tool_choice is "required", the function's name when it names one, else None."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            return str(choice["function"]["name"])
        return "*" if choice == "required" else None

    @property
    def uses_tools(self) -> bool:
        """Whether the template renders the tools and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None: no tools, or tool_choice "none")."""
        return [tool.template_dict() for tool in self.tools or ()] if self.uses_tools else None

    def structured(self, tool_parser: ToolCallParser = _HERMES) -> StructuredOutput | None:
        """The output constraint: a forced tool call's grammar in ``tool_parser``'s format (the server's
        ``--tool-call-parser``), else ``response_format`` / guided_*."""
        forced = self.forced_tool
        if forced is None or not self.tools:
            return super().structured()
        try:
            grammar = tool_parser.call_grammar(
                self.tools, None if forced == "*" else forced, self.parallel_tool_calls is not False
            )
        except (InvalidRequestError, RuntimeError, ValueError) as error:
            raise bad_request(f"tool_choice: {error}", "tool_choice") from None
        return compiled(StructuredOutput.grammar(grammar), "tools")

    def aliases(self) -> dict[str, str]:
        """``max_completion_tokens`` and ``top_logprobs`` reach the engine as max_tokens and logprobs."""
        names = super().aliases()
        if self.top_logprobs is not None:
            names["logprobs"] = "top_logprobs"
        return names

    def sampling_params(self, default_max_tokens: int, tool_parser: ToolCallParser = _HERMES) -> SamplingParams:
        """SamplingParams for this body; without a limit, generate up to ``default_max_tokens``. tool_parser: the
        format tool calls are forced in and parsed from; one whose marker is a special token keeps special tokens
        in the text (unless the body says otherwise), as vLLM does."""
        kwargs = self.sampling_kwargs(self.structured(tool_parser))
        if self.uses_tools and tool_parser.keeps_special_tokens and self.skip_special_tokens is None:
            kwargs["skip_special_tokens"] = False
        limit = self.token_limit
        kwargs["max_tokens"] = default_max_tokens if limit is None else limit
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kwargs)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for model in models for name in model.model_fields)


FIELD_NAMES = _field_names(
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    TextPart,
    StreamOptions,
    ResponseFormat,
    JsonSchemaFormat,
    AssistantToolCall,
    CalledFunction,
)
"""Every field name of the request bodies (error locations are cut at the first part that is not one)."""
