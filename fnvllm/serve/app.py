"""The FastAPI app: routes, Bearer-token check, OpenAI-shaped errors, and the engine's lifetime.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (``responses.py``: OpenAI's
Responses API over the chat path), ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health``, ``GET /metrics`` (Prometheus text), and vLLM's utility routes ``POST /tokenize``,
``POST /detokenize`` (``tokenize.py``), ``GET /version``, ``GET``/``POST /ping`` (``/health``'s answer). Every error,
including unknown routes, is ``{"error": {"message", "type", "param", "code"}}``.

With an API key, every route needs it but ``/health``, ``/ping``, ``/version`` and ``/metrics`` (``OPEN_PATHS``),
because load balancers and Prometheus scrapers carry no bearer token (bind the server to a private address if its
metrics must not be public). vLLM guards only its /v1 routes; here /tokenize and /detokenize need the key too.

``/health`` checks progress, not just life: 200 ``{"status": "ok"}`` while the engine runs and either has no work
(idle is healthy, however long) or has made progress (a step's report) within ``health_stall_s``; 503 with
``{"status": ..., "reason": ...}`` when the engine stopped, or when requests run or wait and no report came for
longer than ``health_stall_s`` (``AsyncEngine.seconds_without_progress``).
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from fnvllm.serve import handlers, responses, tokenize
from fnvllm.serve.async_engine import AsyncEngine
from fnvllm.serve.errors import APIError, internal, model_not_found, unauthorized
from fnvllm.serve.limits import DEFAULT_MAX_REQUEST_BYTES, read_body
from fnvllm.serve.metrics import ServerMetrics
from fnvllm.serve.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})  # probes and scrapers carry no API key
DEFAULT_HEALTH_STALL_S = 300.0  # longer than a long prefill of a big model or CUDA-graph capture


def check_health_stall_s(value: float | None, name: str = "health_stall_s") -> None:
    """Refuse a stall limit that is not a finite number of seconds > 0 (None disables the check); the
    ValueError names ``name`` (the CLI passes its flag's)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:  # refuses nan
        raise ValueError(f"{name} must be a number of seconds > 0 (or none: no stall check), got {value!r}")


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    stream_interval_s: float = 0.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    reasoning_parser: str | None = None,
    tool_parser: str = "hermes",
    model_aliases: Sequence[str] = (),
    health_stall_s: float | None = DEFAULT_HEALTH_STALL_S,
) -> FastAPI:
    """An app serving ``engine`` as ``model_name``; with ``api_key``, every route but /health, /ping, /version and
    /metrics (``OPEN_PATHS``: probes and Prometheus scrapers carry no token) needs ``Authorization: Bearer
    <api_key>``. The app starts the engine (its thread, or the reader of its process) at startup and stops it at
    shutdown.
    ``stream_interval_s``: least time between two chunks of one stream (0: a chunk per engine step).
    ``max_request_bytes``: a larger body is a 413, refused before it is read or parsed.
    ``reasoning_parser``: split chat output into reasoning_content and content (``tool_parsers.REASONING_PARSERS``).
    ``tool_parser``: the format chat tool calls are parsed from (a key of ``tool_parsers.TOOL_PARSERS``).
    ``model_aliases``: more names clients may ask for (vLLM's several ``--served-model-name``s); responses name the
    model ``model_name``, and /v1/models lists every name.
    ``health_stall_s``: /health answers 503 when requests are pending and the engine has made no progress (no
    step's report) for longer than this (None: never; it must be > 0, else ValueError naming it). Keep it well
    above the longest step (a long prefill of a big model) and any warm-up such as CUDA-graph capture.

    If ``engine.observer`` is unset, the app's ``ServerMetrics`` becomes it (``/metrics`` then has latencies)."""
    if tool_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_parser!r}")
    check_health_stall_s(health_stall_s)
    metrics = ServerMetrics(lambda: engine.snapshot)
    if engine.observer is None:
        engine.observer = metrics
    names = (model_name, *(a for a in dict.fromkeys(model_aliases) if a != model_name))
    served = handlers.Served(engine, model_name, stream_interval_s, reasoning_parser, tool_parser, frozenset(names))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="fnvllm", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        """OpenAI completions (``stream: true`` for server-sent events)."""
        return await handlers.completions(served, await read_body(request, max_request_bytes), request.receive)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        """OpenAI chat completions (the tokenizer's chat template; ``stream: true`` for server-sent events)."""
        raw = await read_body(request, max_request_bytes)
        return await handlers.chat_completions(served, raw, request.receive)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API (the chat path underneath; ``stream: true`` for its events)."""
        return await responses.create(served, await read_body(request, max_request_bytes), request.receive)

    created = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        """The model this server serves, once under each of its names."""
        return {"object": "list", "data": [model_card(engine, name, created) for name in names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, object]:
        """The served model by its id (``openai``'s ``models.retrieve``); any other id is a 404."""
        if model_id not in names:
            raise model_not_found(model_id, model_name)
        return model_card(engine, model_id, created)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs and is idle or making progress; 503 naming the reason otherwise."""
        problem = health_problem(engine, health_stall_s)
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": problem[0], "reason": problem[1]}, status_code=503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        """vLLM's /tokenize: the ids of a prompt, or of a conversation as /v1/chat/completions renders it."""
        return await tokenize.tokenize(served, await read_body(request, max_request_bytes))

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        return await tokenize.detokenize(served, await read_body(request, max_request_bytes))

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The fnvllm version serving."""
        return {"version": tokenize.package_version()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def health_problem(engine: AsyncEngine, stall_s: float | None) -> tuple[str, str] | None:
    """Why /health is not 200, as (status, reason), or None when healthy: the engine stopped, or it has had
    work pending without progress for more than ``stall_s`` seconds (None: never stalled)."""
    if not engine.is_alive:
        return "engine stopped", "the engine (its thread, or its process) is not running"
    idle_s = engine.seconds_without_progress()
    if stall_s is None or idle_s is None or idle_s <= stall_s:
        return None
    return "stalled", (
        f"no engine step completed for {idle_s:.1f} s (limit {stall_s:g} s, --health-stall-s) with "
        f"{engine.snapshot.num_running} running and {engine.num_waiting} waiting requests"
    )


def model_card(engine: AsyncEngine, model_name: str, created: int) -> dict[str, object]:
    """A ``/v1/models`` entry: OpenAI's fields, plus what a client needs to build valid requests:
    ``max_model_len`` (most prompt + output tokens of one request) and ``vocab_size`` (token ids are in
    [0, vocab_size); None if unknown)."""
    card: dict[str, object] = {"id": model_name, "object": "model", "created": created, "owned_by": "fnvllm"}
    card["max_model_len"] = engine.max_total_tokens
    card["vocab_size"] = engine.config.vocab_size
    return card


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)
        return _error_response(error)

    async def on_http_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(error.status_code, str(error.detail), kind))

    async def on_unexpected(_: Request, error: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        return _error_response(internal(f"internal server error: {error!r}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


class BearerAuth:
    """ASGI middleware: every HTTP route except ``OPEN_PATHS`` needs ``Authorization: Bearer <api_key>``.

    Plain ASGI (not ``BaseHTTPMiddleware``), so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 401 to a request without the right token; pass everything else on. The scheme's name is
        case-insensitive (RFC 7235: "bearer" is "Bearer"); the token is compared exactly, in constant time."""
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self._expected):
                await _error_response(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)
