"""The generation endpoints: parse the body and build the prompts and SamplingParams (on a worker thread), submit
one engine request per (prompt, candidate), then either stream server-sent events (``sse``) or collect every
output and pick the choices. A client that goes away before its request finished has the engine requests aborted
(their KV blocks are freed between steps).

``n`` copies of a prompt are submitted together, so the prefix cache shares the prompt's KV blocks between them
(only the first computes it; ``/metrics``' fnvllm_prefix_cache_hit_tokens counts the others' hits).

``use_beam_search`` submits nothing up front: ``serve.beam`` drives the search, one batch of one-token requests per
step, each submitted and collected as a plain request's (``_submit_batch``, ``collect_all``)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import attrs
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from fnvllm.engine.text import check_stop_strings, render_chat, resolve_bad_words
from fnvllm.executor.base import TokenLogprobs
from fnvllm.serve import beam as serve_beam
from fnvllm.serve import sse
from fnvllm.serve.async_engine import AsyncEngine, EngineOverloaded, Submission
from fnvllm.serve.errors import (
    bad_request,
    from_invalid_request,
    from_validation_error,
    internal,
    model_not_found,
    unavailable,
)
from fnvllm.serve.formats import ChatFormat, Choice, CompletionFormat, echoed_logprobs, usage
from fnvllm.serve.limits import MAX_JSON_DEPTH, check_depth
from fnvllm.serve.protocol import FIELD_NAMES, ChatCompletionRequest, CompletionRequest
from fnvllm.serve.stream import EngineFailure, RequestStream
from fnvllm.serve.tool_parsers import REASONING_PARSERS, TOOL_PARSERS, ParsedChatFormat
from fnvllm.state import InvalidRequestError, SamplingParams, copies
from fnvllm.state.params import truncate_prompt

Body = TypeVar("Body", bound=BaseModel)
Format = CompletionFormat | ChatFormat


@attrs.frozen
class Served:
    """What the handlers serve: the engine and the one model name clients must ask for.

    reasoning_parser: a key of ``tool_parsers.REASONING_PARSERS`` (``--reasoning-parser``): chat output is split
    into reasoning_content and content. tool_parser: the format tool calls are parsed from (a key of
    ``tool_parsers.TOOL_PARSERS``).
    """

    engine: AsyncEngine
    model_name: str
    stream_interval_s: float = 0.0
    reasoning_parser: str | None = None
    tool_parser: str = "hermes"
    names: frozenset[str] = frozenset()  # every name clients may ask for (model_name's too); empty: model_name only


def parse(model: type[Body], raw: bytes, field_names: Collection[str] = FIELD_NAMES) -> Body:
    """The validated body, or a 400 naming the first bad field (or saying the JSON is malformed or too deep).
    field_names: every field name of ``model``'s body (``errors.from_validation_error`` cuts an error's place
    there); the chat and completions bodies' by default."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # the parser recurses per level: ~1,000 levels exhaust the stack
        raise bad_request(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    check_depth(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error, field_names) from None


@attrs.frozen
class Prepared:
    """A parsed request, ready to submit: one engine request per (prompt, candidate), and how to answer.

    jobs: SamplingParams per engine request, prompt-major: prompt p's candidates are
        ``jobs[p * num_candidates : (p + 1) * num_candidates]``; ``prompts[p]`` holds its ids and text.
    num_choices / num_candidates: ``n`` and ``best_of`` per prompt (the best n of best_of are returned).
    echo: prepend each prompt's text to its choices (and, with logprobs, its tokens' logprobs). logprobs: the
    client asked for logprobs. scores_only: max_tokens 0: the one token the engine generated is dropped.
    aliases: engine field -> body field, for errors raised at submit (see ``errors.from_invalid_request``).
    beam: the beam search to run instead (``use_beam_search``; ``jobs`` is then empty).
    """

    prompts: list[tuple[list[int], str | None]]
    jobs: list[SamplingParams]
    num_choices: int
    num_candidates: int
    is_stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool
    logprobs: bool
    aliases: dict[str, str]
    parse_tools: bool = False
    include_reasoning: bool = True
    scores_only: bool = False
    beam: serve_beam.BeamPlan | None = None

    def prompt_of(self, job: int) -> int:
        """The prompt index of engine request ``job``."""
        return job // self.num_candidates

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt counted once, whatever its n)."""
        return sum(len(ids) for ids, _ in self.prompts)


async def completions(served: Served, raw: bytes, receive: Receive) -> Response:
    """``POST /v1/completions``. Parsing and tokenization run on a worker thread: a large prompt never holds
    the event loop (``/health`` and every stream keep answering)."""
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", served.model_name, served.engine.tokenizer)
    return await _respond(served, fmt, await start(_prepare_completion, served, raw, fmt.request_id), receive)


async def chat_completions(served: Served, raw: bytes, receive: Receive) -> Response:
    """``POST /v1/chat/completions``: the tokenizer's chat template (on a worker thread), then generation."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    started = await start(_prepare_chat, served, raw, request_id)
    return await _respond(served, _chat_format(served, request_id, started[0]), started, receive)


def _chat_format(served: Served, request_id: str, job: Prepared) -> ChatFormat:
    """The plain chat format, or one that parses tool calls (the request has tools) and reasoning (the server
    has a reasoning parser; ``include_reasoning: false`` drops the reasoning)."""
    tokenizer = served.engine.tokenizer
    reasoning = REASONING_PARSERS[served.reasoning_parser] if served.reasoning_parser is not None else None
    if not job.parse_tools and reasoning is None:
        return ChatFormat(request_id, served.model_name, tokenizer)
    tools = TOOL_PARSERS[served.tool_parser]() if job.parse_tools else None
    return ParsedChatFormat(request_id, served.model_name, tokenizer, tools, reasoning, not job.include_reasoning)


Started = tuple[Prepared, list[RequestStream]]


async def start(prepare: Callable[[Served, bytes], Prepared], served: Served, raw: bytes, request_id: str) -> Started:
    """Parse, tokenize, validate and submit on a worker thread (one hop): the event loop does none of it."""
    aloop = asyncio.get_running_loop()

    def run() -> Started:
        job = prepare(served, raw)
        return job, [] if job.beam is not None else _submit(served.engine, job, request_id, aloop)

    return await asyncio.to_thread(run)


def _prepare_completion(served: Served, raw: bytes) -> Prepared:
    body = parse(CompletionRequest, raw)
    check_model(body.model, served, body.check_supported)
    params = _sampling_params(served, body.sampling_params, body.aliases())
    try:
        check_stop_strings(served.engine.tokenizer, params)  # refused now (a 400), not when the engine adds it
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None
    prompts = []
    for prompt in body.prompts():
        ids = _encode(served.engine, prompt) if isinstance(prompt, str) else prompt
        kept = _truncated(ids, params.truncate_prompt_tokens)
        if isinstance(prompt, str) and len(kept) == len(ids):
            prompts.append((kept, prompt))
        else:  # token ids, or a text prompt cut short: echo the kept tokens' text
            prompts.append((kept, _decode(served.engine, kept) if body.echo else None))
    searched = _beam_plan(served, body, prompts, params)
    jobs = [] if searched is not None else copies(params, body.num_candidates) * len(prompts)
    return Prepared(
        prompts, jobs, body.num_choices, body.num_candidates, bool(body.stream),
        body.include_usage, body.continuous_usage, bool(body.echo), body.logprobs is not None, body.aliases(),
        scores_only=body.scores_only, beam=searched,
    )  # fmt: skip


def _prepare_chat(served: Served, raw: bytes) -> Prepared:
    return prepare_chat(served, parse(ChatCompletionRequest, raw))


def prepare_chat(served: Served, body: ChatCompletionRequest, aliases: dict[str, str] | None = None) -> Prepared:
    """A chat body, checked, rendered with the chat template and ready to submit (``/v1/responses`` builds its
    body and comes here too). ``aliases``: engine field -> the field the client sent (default: the body's own)."""
    check_model(body.model, served, body.check_supported)
    messages = [m.template_dict() for m in body.messages]
    ids = render_chat_ids(served.engine, messages, body.template_tools(), body.chat_template_kwargs or {})
    ids = _truncated(ids, body.truncate_prompt_tokens)  # before the room left for max_tokens is measured
    room = served.engine.max_total_tokens - len(ids)
    if room < 1:
        limit = served.engine.max_total_tokens - 1
        raise bad_request(f"messages: the conversation is {len(ids)} tokens; at most {limit} fit", "messages")
    tool_parser = TOOL_PARSERS[served.tool_parser].for_tokenizer(served.engine.tokenizer)  # forced calls' form
    aliases = body.aliases() if aliases is None else aliases
    params = _sampling_params(served, lambda: body.sampling_params(room, tool_parser), aliases)
    n = body.num_choices
    searched = _beam_plan(served, body, [(ids, None)], params)
    return Prepared(
        [(ids, None)], [] if searched is not None else copies(params, n), n, n, bool(body.stream), body.include_usage,
        body.continuous_usage, False, bool(body.logprobs), aliases, body.uses_tools,
        body.include_reasoning is not False, beam=searched,
    )  # fmt: skip


def _beam_plan(
    served: Served, body: CompletionRequest | ChatCompletionRequest, prompts: serve_beam.Prompts, params: SamplingParams
) -> serve_beam.BeamPlan | None:
    """The body's beam search (None without ``use_beam_search``): its ``n`` beams under ``params``."""
    if not body.use_beam_search:
        return None
    return serve_beam.prepare(
        prompts, params, body.num_choices, body.length_penalty, served.engine.config, body.aliases()
    )


def check_model(model: str | None, served: Served, check_supported: Callable[[], None]) -> None:
    """A 404 when a body names a model this server does not serve (under any of its names); then the body's own
    ``check_supported``."""
    if model is not None and model != served.model_name and model not in served.names:
        raise model_not_found(model, served.model_name)
    check_supported()


def _encode(engine: AsyncEngine, text: str) -> list[int]:
    if engine.tokenizer is None:
        raise bad_request("prompt: this server has no tokenizer; send token ids", "prompt")
    return list(engine.tokenizer.encode(text))


def render_chat_ids(
    engine: AsyncEngine,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of the conversation with the assistant's turn opened (the template adds its own BOS); ``tools``
    are rendered by the template (its own tool-calling instructions); ``template_kwargs`` are the request's
    chat_template_kwargs (checked against RESERVED_TEMPLATE_KWARGS already). ``add_special_tokens``: the
    tokenizer adds its own around the rendered text too (vLLM's /tokenize option; chat completions never do)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = render_chat(tokenizer, messages, **(template_kwargs or {}), **({"tools": tools} if tools else {}))
    except InvalidRequestError as error:  # the template rejects the conversation (e.g. role order) or a kwarg
        raise bad_request(str(error), "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _decode(engine: AsyncEngine, ids: list[int]) -> str:
    """A token-id prompt as text, for ``echo`` ("" without a tokenizer: the ids are the prompt). Ids the tokenizer
    cannot decode give "": the prompt is not validated yet, and submitting it answers a 400 naming them."""
    if engine.tokenizer is None:
        return ""
    try:
        return engine.tokenizer.decode(ids)
    except (ValueError, TypeError, OverflowError, IndexError):
        return ""


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's ids as the engine will see them: its last ``keep`` (``truncate_prompt``, the offline API's rule
    too); a ``keep`` below 1 is a 400 naming truncate_prompt_tokens."""
    try:
        return ids if keep is None else list(truncate_prompt(ids, keep))
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None


def _sampling_params(served: Served, build: Callable[[], SamplingParams], aliases: dict[str, str]) -> SamplingParams:
    """The body's SamplingParams (``build``), its bad_words resolved to ids with the server's tokenizer (the
    offline API's rule, ``resolve_bad_words``); a 400 naming the field when either step refuses it."""
    try:
        return resolve_bad_words(served.engine.tokenizer, build())
    except (ValueError, TypeError) as error:  # InvalidRequestError is a ValueError naming the field
        raise from_invalid_request(ValueError(str(error)), aliases) from None


def _submit(
    engine: AsyncEngine, job: Prepared, request_id: str, aloop: asyncio.AbstractEventLoop
) -> list[RequestStream]:
    """Queue every engine request of ``job`` (all or none); ids are ``request_id`` or ``request_id-k``. Runs on a
    worker thread (validating a long prompt takes a while); ``aloop`` reads the streams."""
    many = len(job.jobs) > 1
    submissions = []
    for k, params in enumerate(job.jobs):
        ids, text = job.prompts[job.prompt_of(k)]
        submissions.append(Submission(ids, params, text, f"{request_id}-{k}" if many else request_id))
    return _submit_batch(engine, submissions, job.aliases, aloop)


def _submit_batch(
    engine: AsyncEngine, submissions: list[Submission], aliases: dict[str, str], aloop: asyncio.AbstractEventLoop
) -> list[RequestStream]:
    """``engine.submit_many``, its refusals as errors for the client: 503 when overloaded, 400 naming the field."""
    try:
        return engine.submit_many(submissions, aloop)
    except EngineOverloaded as error:
        raise unavailable(str(error)) from None
    except ValueError as error:
        raise from_invalid_request(error, aliases) from None


async def _respond(served: Served, fmt: Format, started: Started, receive: Receive) -> Response:
    engine, (job, streams) = served.engine, started
    if job.beam is not None:
        return await _respond_beam(served, fmt, job, job.beam, receive)
    if job.is_stream:
        echo = [job.prompts[job.prompt_of(k)][1] or "" for k in range(len(streams))] if job.echo else None
        echo_ids = [job.prompts[job.prompt_of(k)][0] for k in range(len(streams))] if job.echo else None
        plan = sse.StreamPlan(
            echo, job.include_usage, job.continuous_usage, job.logprobs, job.num_prompt_tokens,
            served.stream_interval_s, echo_ids if job.logprobs else None,
        )  # fmt: skip
        events = sse.events(fmt, streams, plan)
        return sse.EventStream(events, on_close=lambda: abort_unfinished(engine, streams))
    collected = await collect_all(engine, streams, receive)
    if collected is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    if job.scores_only:
        collected = [attrs.evolve(c, text="", token_ids=(), logprobs=(), finish_reason="length") for c in collected]
    counts = usage(job.num_prompt_tokens, sum(len(c.token_ids) for c in collected))
    return JSONResponse(fmt.final(_choose(job, collected), counts))


async def _respond_beam(
    served: Served, fmt: Format, job: Prepared, plan: serve_beam.BeamPlan, receive: Receive
) -> Response:
    """Run the beam search: each step's batch submitted on a worker thread and collected as plain requests are;
    the answer holds each prompt's n best beams (``_choose`` numbers them and adds the echo), its usage their
    generated tokens. Streamed, the opening chunks go out at once and the choices once the search is done
    (``sse.final_events``); a client that leaves cancels the search, whose step requests are then aborted."""
    engine, aloop = served.engine, asyncio.get_running_loop()

    async def run_batch(batch: list[Submission]) -> list[Choice] | None:
        streams = await asyncio.to_thread(_submit_batch, engine, batch, job.aliases, aloop)
        return await collect_all(engine, streams, receive)

    async def answer() -> list[Choice] | None:
        searched = await serve_beam.search(plan, job.prompts, fmt.request_id, run_batch)
        return None if searched is None else _choose(job, serve_beam.choices(searched, plan, engine.tokenizer))

    if job.is_stream:
        stream_plan = sse.StreamPlan(None, job.include_usage, job.continuous_usage, job.logprobs, job.num_prompt_tokens)
        # Nothing to abort on close: each step's requests are aborted by ``_collect_or_abort`` when cancelled.
        events = sse.final_events(fmt, len(job.prompts) * job.num_choices, answer, stream_plan)
        return sse.EventStream(events, on_close=lambda: None)
    chosen = await answer()
    if chosen is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    counts = usage(job.num_prompt_tokens, sum(len(c.token_ids) for c in chosen))
    return JSONResponse(fmt.final(chosen, counts))


def _choose(job: Prepared, collected: list[Choice]) -> list[Choice]:
    """The returned choices: per prompt, its n best candidates by mean logprob per token (all of them when
    best_of == n), numbered prompt-major; echo prepends the prompt's text (and its logprobs, when asked)."""
    chosen = []
    for p, (ids, text) in enumerate(job.prompts):
        candidates = collected[p * job.num_candidates : (p + 1) * job.num_candidates]
        if job.num_candidates > job.num_choices:
            candidates = sorted(candidates, key=_mean_logprob, reverse=True)[: job.num_choices]
        for r, c in enumerate(candidates):
            prefix = (text or "") if job.echo else ""
            logprobs = c.logprobs if job.logprobs else None
            if logprobs is not None and job.echo:
                logprobs = echoed_logprobs(ids, c.prompt_logprobs) + logprobs
            chosen.append(attrs.evolve(c, index=p * job.num_choices + r, text=prefix + c.text, logprobs=logprobs))
    return chosen


def _mean_logprob(choice: Choice) -> float:
    logprobs = [lp for lp in choice.logprobs or () if not isinstance(lp, int)]
    return sum(lp.logprob for lp in logprobs) / len(logprobs) if logprobs else float("-inf")


async def _collect(stream: RequestStream) -> Choice:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    finish_reason = None
    prompt_logprobs = None
    async for event in stream:
        text.append(event.text)
        token_ids.extend(event.token_ids)
        logprobs.extend(event.logprobs)
        finish_reason = event.finish_reason
        if event.prompt_logprobs is not None:
            prompt_logprobs = event.prompt_logprobs
    return Choice(0, "".join(text), tuple(token_ids), tuple(logprobs), finish_reason, prompt_logprobs)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_all(engine: AsyncEngine, streams: list[RequestStream], receive: Receive) -> list[Choice] | None:
    """``_collect_or_abort``; a 503 when the engine aborted one of them (the server is shutting down)."""
    collected = await _collect_or_abort(engine, streams, receive)
    if collected is not None and any(c.finish_reason == "abort" for c in collected):
        raise unavailable("the request was aborted: the server is shutting down")
    return collected


async def _collect_or_abort(engine: AsyncEngine, streams: list[RequestStream], receive: Receive) -> list[Choice] | None:
    """Every stream's whole output, or None if the client disconnected first (then the requests are aborted)."""
    collecting = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in streams)))
    watching = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        # Cancelling a gather only asks its children to stop: it is not done (nor cancelled) until they have, so
        # whether the client left is decided here, before the cancel, not by asking the gather afterwards.
        disconnected = not collecting.done()
        if disconnected:
            _abandon(collecting)
            abort_unfinished(engine, streams)
    if disconnected:
        return None
    try:
        return collecting.result()
    except EngineFailure as error:
        abort_unfinished(engine, streams)
        raise internal(str(error)) from None


def _abandon(future: asyncio.Future[Any]) -> None:
    """Cancel ``future`` and retrieve its outcome when it settles, so asyncio logs no unretrieved exception."""
    future.cancel()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def abort_unfinished(engine: AsyncEngine, streams: list[RequestStream]) -> None:
    """Abort the engine requests of ``streams`` that have not finished (their client went away)."""
    for stream in streams:
        if not stream.finished:
            engine.abort(stream.request_id)
