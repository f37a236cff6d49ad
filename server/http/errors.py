"""The map from the bridge's errors to HTTP status and OpenAI's error JSON; the one place where it lives.

The error tree is ``core.errors`` (each class names its gRPC code); this module turns that code into
an HTTP status and the body OpenAI clients parse::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

``code`` is the HTTP status, as vLLM sends it. A request body that does not validate is a 400 whose
``param`` names the field (``error_for_validation``); anything that is not a ``PrimeRLError`` is a bug,
logged with its traceback and answered 500 without detail.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from core.errors import InvalidArgument, PrimeRLError

log = logging.getLogger("primerl.server.http")

# gRPC code name -> (HTTP status, OpenAI error type).
STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "FAILED_PRECONDITION": (409, "conflict_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
INTERNAL = (500, "internal_error")


class BadParam(InvalidArgument):
    """A request field the front door refuses; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class BodyTooLarge(InvalidArgument):
    """The request body is larger than ``http.max_body_bytes`` (413, not 400)."""


def status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type of ``exc``."""
    if isinstance(exc, BodyTooLarge):
        return 413, "invalid_request_error"
    if isinstance(exc, PrimeRLError):
        return STATUS.get(exc.code, INTERNAL)
    return INTERNAL


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and OpenAI error JSON for ``exc`` (a non-``PrimeRLError`` is logged as a bug)."""
    status, kind = status_of(exc)
    if isinstance(exc, PrimeRLError):
        message = exc.message
    else:
        log.error("internal error in the HTTP front door", exc_info=exc)
        message = "internal error in the bridge; see the server log"
    param = getattr(exc, "param", None)
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["retry-after"] = str(max(1, round(retry)))
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: BaseException) -> str:
    """A mid-stream error as vLLM sends it: one SSE event with the error JSON (then ``[DONE]``)."""
    return f"data: {json.dumps(error_body(exc)[1])}\n\n"


def error_for_validation(exc: ValidationError, prefix: str = "") -> BadParam:
    """The first validation error of a request body as a 400 naming its field (``messages[2].role``)."""
    first = exc.errors(include_url=False)[0]
    path = prefix
    for part in first["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return BadParam(path or "body", f"{path or 'body'}: {first['msg']}")
