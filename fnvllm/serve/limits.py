"""Limits on what one request may make the server do before it is refused: body size and JSON nesting depth.

Both are checked before the expensive part: the body size from ``Content-Length`` before a byte is read (and
again while the body streams in, for chunked uploads or a lying header), the depth before the body is validated.
A 50 MB prompt or an array nested 100,000 deep is then a quick 413 or 400, never a stalled server or a 500.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from fnvllm.serve.errors import APIError, bad_request

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""``fnvllm serve --max-request-bytes``'s default: 8 MiB, about two million tokens of English text."""
MAX_REQUEST_BYTES_LIMIT = 1 << 40
"""The largest ``--max-request-bytes`` accepted (1 TiB): beyond it the limit is no limit."""
MAX_JSON_DEPTH = 32
"""The deepest nesting of arrays and objects a body may have. The deepest the API needs is 5
(``messages[i].content[j]``); Python's JSON parser itself recurses, and fails near 1,000."""


def too_large(max_bytes: int, what: str) -> APIError:
    """413 for a body over ``max_bytes``."""
    message = f"the request body {what} exceeds this server's limit of {max_bytes} bytes (--max-request-bytes)"
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused with a 413 as soon as it is known to exceed ``max_bytes``: from its
    ``Content-Length`` before reading, else once the bytes received pass the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes, f"({declared} bytes)")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise too_large(max_bytes, "(streamed)")
        parts.append(part)
    return b"".join(parts)


def check_depth(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 if ``data`` (parsed JSON) nests arrays and objects deeper than ``max_depth``.

    Iterative, and visits only containers' members: a flat list of a million ids costs one pass over it."""
    level: list[Any] = [data]
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise bad_request(f"the request body nests arrays and objects deeper than {max_depth} levels")
        children: list[Any] = []
        for value in level:
            members = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
            children.extend(m for m in members if isinstance(m, (dict, list)))
        level = children
