"""The front door's errors as OpenAI's error JSON, with the status of the one HTTP map (``core.errors``).

Each class of the error tree names its HTTP status (``core.errors.http_status``); this module writes the body
OpenAI clients parse::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

``code`` is the HTTP status, as vLLM sends it; ``type`` follows the status (``core.errors_http``). A request
body that does not validate is a 400 whose ``param`` names the field (``error_for_validation``); anything that
is not a ``PrimeRLError`` is a bug, logged with its traceback and answered 500 without detail.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from core.errors import InvalidArgument, PrimeRLError, http_status
from core.errors_http import json_error, openai_error_type

log = logging.getLogger("primerl.server.http")


class BadParam(InvalidArgument):
    """A request field the front door refuses; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class BodyTooLarge(InvalidArgument):
    """The request body is larger than ``http.max_body_bytes`` (413, not 400)."""

    http_status = 413


def status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type of ``exc``."""
    status = http_status(exc)
    return status, openai_error_type(status)


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
    return json_error(exc, error_body(exc)[1])


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
