"""The OpenAI-compatible HTTP server (``fnvllm serve``): one engine thread, FastAPI + uvicorn in front.

    from fnvllm.llm import LLM
    from fnvllm.serve import AsyncEngine, serve

    llm = LLM("path/to/model")
    serve(AsyncEngine(llm.loop, llm.tokenizer, max_waiting=1024), "my-model", port=8000)

Files (one per box): ``async_engine`` (the engine thread), ``stream`` (one request's asyncio stream of events),
``app`` (routes, auth, errors), ``handlers`` (completions and chat: parse, submit, stream or collect),
``protocol`` (request bodies), ``formats`` (response bodies), ``errors`` (OpenAI error JSON), ``metrics``
(Prometheus), ``server`` (uvicorn, signals), ``process`` (``fnvllm serve`` as a child process, for tests and
benchmarks). Needs the ``[serve]`` extra: fastapi, uvicorn, prometheus-client.
"""

from fnvllm.serve.app import build_app
from fnvllm.serve.async_engine import AsyncEngine, EngineOverloaded, EngineSnapshot
from fnvllm.serve.server import serve
from fnvllm.serve.stream import EngineFailure, RequestStream, TokenEvent

__all__ = [
    "AsyncEngine",
    "EngineFailure",
    "EngineOverloaded",
    "EngineSnapshot",
    "RequestStream",
    "TokenEvent",
    "build_app",
    "serve",
]
