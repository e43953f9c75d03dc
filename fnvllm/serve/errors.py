"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Every way a request can go wrong maps to one ``APIError``; handlers raise it and the app's exception handler
renders it. User input is never answered with a 500: only an engine failure is.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, "invalid_request_error", param)


def model_not_found(name: str, served: str) -> APIError:
    """404 for a model name this server does not serve."""
    message = f"The model `{name}` does not exist; this server serves `{served}`"
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    """401 for a missing or wrong Bearer token."""
    message = "Invalid or missing API key: send the header 'Authorization: Bearer <key>'"
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def unavailable(message: str) -> APIError:
    """503: the waiting queue is full, or the server is shutting down. Clients may retry later."""
    return APIError(503, message, "server_error", None, "overloaded")


def internal(message: str) -> APIError:
    """500: the engine failed while running the request (never caused by the request's own fields)."""
    return APIError(500, message, "server_error", None, "internal_error")


def from_validation_error(error: ValidationError, field_names: Collection[str]) -> APIError:
    """400 naming the first offending field of a pydantic error (``messages.0.role: Input should be ...``).

    A union adds its member types to the error's location (``temperature.int``); the param stops at the first
    part that is neither a list index nor one of ``field_names``, and the members' messages are joined."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "extra_forbidden":  # the location ends in the unknown field's own name
        name = ".".join(str(part) for part in first["loc"])
        return bad_request(f"{name}: unknown or unsupported field", name)
    param = _param(first["loc"], field_names)
    same = [e for e in errors if _param(e["loc"], field_names) == param]
    message = " or ".join(dict.fromkeys(e["msg"] for e in same))
    return bad_request(f"{param}: {message}" if param else message, param)


def _param(loc: tuple[int | str, ...], field_names: Collection[str]) -> str | None:
    parts = []
    for part in loc:
        if not isinstance(part, int) and part not in field_names:
            break
        parts.append(str(part))
    return ".".join(parts) or None


_FIELD = re.compile(r"^([a-z_]+)\b")


def from_invalid_request(error: ValueError, aliases: Mapping[str, str] | None = None) -> APIError:
    """400 for the engine's own validation (``SamplingParams`` ranges, prompt too long): its message names the
    field first (``SamplingParams.top_p must be in (0, 1], got 2.0`` or ``max_tokens: prompt (9) + ...``).

    aliases: engine field -> the body field the client sent (``max_tokens`` -> ``max_completion_tokens``); the
    message and param then say the name the client used."""
    message = str(error).removeprefix("SamplingParams.")
    for engine_name, sent in (aliases or {}).items():
        message = re.sub(rf"\b{engine_name}\b", sent, message)
    match = _FIELD.match(message)
    return bad_request(message, match.group(1) if match else None)
