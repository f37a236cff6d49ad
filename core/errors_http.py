"""The HTTP edge of the one error map (``core.errors``): an app's own error body sent with the error's status.

A module of its own so that ``import core.errors`` stays free of starlette. Each HTTP app (the front door,
the verifier, the OpenEnv apps) keeps its documented body and takes the status from here: ``json_error``.
The front door's OpenAI error JSON also names a ``type``, which follows the status (``openai_error_type``).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from core.errors import http_status

# HTTP status -> OpenAI's ``error.type`` (the classes of OpenAI's SDK follow the status the same way).
OPENAI_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "unprocessable_entity_error",
    429: "rate_limit_error",
    500: "internal_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def openai_error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    return OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")


def retry_after(exc: BaseException) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds, at least 1) of an error that carries ``retry_after_s``."""
    retry = getattr(exc, "retry_after_s", None)
    return {} if retry is None else {"retry-after": str(max(1, round(retry)))}


def json_error(exc: BaseException, body: Any) -> JSONResponse:
    """``body`` (the app's own error JSON) with ``exc``'s HTTP status, and ``Retry-After`` when it carries one."""
    return JSONResponse(body, status_code=http_status(exc), headers=retry_after(exc))
