"""vLLM's utility endpoints over the served tokenizer: ``POST /tokenize``, ``POST /detokenize``, and the version
``GET /version`` reports. None of them touches the engine loop.

``/tokenize`` takes a text prompt (``{"prompt": ...}``: the ids /v1/completions sends for it, BOS and all by
default) or a conversation (``{"messages": [...]}``: the ids /v1/chat/completions sends for it, rendered by the
very code that endpoint calls, ``handlers.render_chat_ids``, after the same checks). It answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the tokenizer's own piece of each id, with
``return_token_strs``; else null). ``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``.

Worked example with the test tokenizer on a server of max_model_len 512: ``{"prompt": "hello"}`` ->
``{"count": 5, "max_model_len": 512, "tokens": [0, 246, 111, 111, 114], "token_strs": null}`` (0 is ``<s>``);
``{"tokens": [246, 111, 111, 114]}`` -> ``{"prompt": "hello"}``.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.responses import JSONResponse, Response

from fnvllm.serve import handlers
from fnvllm.serve.async_engine import AsyncEngine
from fnvllm.serve.errors import bad_request, from_validation_error
from fnvllm.serve.protocol import FIELD_NAMES, ChatCompletionRequest, ChatMessage, Text
from fnvllm.serve.tool_parsers import ToolSpec

Body = TypeVar("Body", bound=BaseModel)


class _Strict(BaseModel):
    """A body that rejects fields it does not declare."""

    model_config = ConfigDict(extra="forbid")


class TokenizePromptRequest(_Strict):
    """``POST /tokenize`` with a text prompt. add_special_tokens: the tokenizer adds its own (BOS, ...), as
    /v1/completions does with a text prompt. return_token_strs: answer each id's token string too."""

    model: StrictStr | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with a conversation, rendered as /v1/chat/completions renders it.

    add_generation_prompt: open the assistant's turn (None, the default: unless continue_final_message).
    continue_final_message: leave the last (assistant) message open; not with add_generation_prompt true.
    chat_template_kwargs: more template arguments, as in chat completions; they win over the two above (as vLLM's).
    add_special_tokens: the tokenizer adds its own special tokens around the rendered text too (False, the default:
        the template adds the model's, as chat completions does).
    """

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    tools: list[ToolSpec] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The conversation as a /v1/chat/completions body (same messages, tools and template arguments)."""
        return ChatCompletionRequest(
            messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs
        )

    def check_supported(self) -> None:
        """Raise a 400 naming the field: both turn options true, or anything chat completions refuses in the
        messages, tools or chat_template_kwargs."""
        if self.continue_final_message and self.add_generation_prompt:
            message = "continue_final_message: not allowed with add_generation_prompt true (send it false)"
            raise bad_request(message, "continue_final_message")
        self.as_chat().check_supported()

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's arguments: the turn options, then chat_template_kwargs over them."""
        opens_turn = self.add_generation_prompt
        if opens_turn is None:
            opens_turn = not self.continue_final_message
        turn = {"add_generation_prompt": opens_turn, "continue_final_message": self.continue_final_message}
        return {**turn, **(self.chat_template_kwargs or {})}


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids, each in [0, vocab_size)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


_FIELD_NAMES = FIELD_NAMES | {
    name for body in (TokenizePromptRequest, TokenizeChatRequest, DetokenizeRequest) for name in body.model_fields
}
"""Every field name of these bodies (a validation error's param stops at the first part that is not one)."""


async def tokenize(served: handlers.Served, raw: bytes) -> Response:
    """``POST /tokenize``; parsing, rendering and encoding run on a worker thread (a long prompt never holds the
    event loop)."""
    return await asyncio.to_thread(_tokenize, served, raw)


async def detokenize(served: handlers.Served, raw: bytes) -> Response:
    """``POST /detokenize``, on a worker thread."""
    return await asyncio.to_thread(_detokenize, served, raw)


def package_version() -> str:
    """fnvllm's version as installed (its distribution's metadata); "unknown" when it runs uninstalled (from a
    source folder on ``PYTHONPATH``)."""
    try:
        return metadata.version("fnvllm")
    except metadata.PackageNotFoundError:
        return "unknown"


def _tokenize(served: handlers.Served, raw: bytes) -> Response:
    data = _json_object(raw)
    if "messages" in data:
        chat = _validated(TokenizeChatRequest, data)
        handlers.check_model(chat.model, served, chat.check_supported)
        ids = _chat_ids(served.engine, chat)
        return _tokens_response(served.engine, ids, bool(chat.return_token_strs))
    body = _validated(TokenizePromptRequest, data)
    handlers.check_model(body.model, served, lambda: None)
    ids = list(_tokenizer(served.engine, "prompt").encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return _tokens_response(served.engine, ids, bool(body.return_token_strs))


def _chat_ids(engine: AsyncEngine, body: TokenizeChatRequest) -> list[int]:
    """The conversation's ids, by the chat endpoint's own rendering (``handlers._prepare_chat``'s two lines)."""
    chat = body.as_chat()
    messages = [m.template_dict() for m in chat.messages]
    tools, kwargs = chat.template_tools(), body.template_kwargs()
    return handlers.render_chat_ids(engine, messages, tools, kwargs, body.add_special_tokens)


def _tokens_response(engine: AsyncEngine, ids: list[int], with_strs: bool) -> Response:
    strs = list(engine.tokenizer.convert_ids_to_tokens(ids)) if with_strs else None
    body = {"count": len(ids), "max_model_len": engine.max_total_tokens, "tokens": ids, "token_strs": strs}
    return JSONResponse(body)


def _detokenize(served: handlers.Served, raw: bytes) -> Response:
    body = _validated(DetokenizeRequest, _json_object(raw))
    handlers.check_model(body.model, served, lambda: None)
    tokenizer = _tokenizer(served.engine, "tokens")
    known = served.engine.config.vocab_size
    vocab_size = len(tokenizer) if known is None else known  # the model's, else the tokenizer's
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab_size:
            raise bad_request(f"tokens.{i}: {token} is not a token id in [0, {vocab_size}) (vocab_size)", f"tokens.{i}")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens)})


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, refused as every endpoint refuses one (``handlers.parse``: malformed, too deep,
    not an object); the form is chosen from its keys before it is validated."""
    return handlers.parse(RootModel[dict[str, Any]], raw).root


def _validated(model: type[Body], data: dict[str, Any]) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error, _FIELD_NAMES) from None


def _tokenizer(engine: AsyncEngine, field: str) -> Any:
    if engine.tokenizer is None:
        raise bad_request(f"{field}: this server has no tokenizer (its checkpoint has no tokenizer files)", field)
    return engine.tokenizer
