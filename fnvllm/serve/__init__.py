"""The OpenAI-compatible HTTP server (``fnvllm serve``): one engine loop, FastAPI + uvicorn in front.

    from fnvllm.engine.text import load_local_tokenizer
    from fnvllm.serve import ProcessEngine, serve

    engine = ProcessEngine("path/to/model", {}, load_local_tokenizer(Path("path/to/model")), max_waiting=1024)
    serve(engine, "my-model", port=8000)           # the engine runs in a process of its own

    serve(AsyncEngine(llm.loop, llm.tokenizer), "my-model")   # or on a thread of this one, from an LLM

Files (one per box): ``async_engine`` (the engine core and its front, core on a thread), ``engine_process``
(the core in its own process), ``stream`` (one request's asyncio stream of events),
``app`` (routes, auth, errors), ``handlers`` (completions and chat: parse, submit, collect and choose), ``sse``
(server-sent events of one request's choices), ``limits`` (body size, JSON depth), ``protocol`` (request
bodies), ``formats`` (response bodies), ``errors`` (OpenAI error JSON), ``metrics``
(Prometheus), ``server`` (uvicorn, signals), ``process`` (``fnvllm serve`` as a child process, for tests and
benchmarks). Needs the ``[serve]`` extra: fastapi, uvicorn, prometheus-client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fnvllm.serve.app import build_app
    from fnvllm.serve.async_engine import AsyncEngine, EngineOverloaded, EngineSnapshot
    from fnvllm.serve.engine_process import EngineStartupError, ProcessEngine
    from fnvllm.serve.server import EngineStoppedError, serve
    from fnvllm.serve.stream import EngineFailure, RequestStream, TokenEvent

# Public name -> the module that defines it. Imported on first use (PEP 562), so the modules that need no web
# framework (``formats``, ``server_process``, ...) import without the [serve] extra.
_EXPORTS = {
    "AsyncEngine": "async_engine",
    "EngineFailure": "stream",
    "EngineOverloaded": "async_engine",
    "EngineSnapshot": "async_engine",
    "EngineStartupError": "engine_process",
    "EngineStoppedError": "server",
    "ProcessEngine": "engine_process",
    "RequestStream": "stream",
    "TokenEvent": "stream",
    "build_app": "app",
    "serve": "server",
}

__all__ = [
    "AsyncEngine",
    "EngineFailure",
    "EngineOverloaded",
    "EngineSnapshot",
    "EngineStartupError",
    "EngineStoppedError",
    "ProcessEngine",
    "RequestStream",
    "TokenEvent",
    "build_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, from its module (imported now); AttributeError for any other name, so that
    ``from fnvllm.serve import handlers`` still imports the submodule."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
