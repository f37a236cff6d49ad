"""The gRPC edge of the one error map (``core.errors``): an exception's ``grpc.StatusCode``, and a call ended with it.

A module of its own so that ``import core.errors`` stays free of grpc. Every gRPC servicer (the bridge, the
verifier, the control plane) ends a failed call here or through ``grpc_status``: a ``PrimeRLError`` with its
code and message, anything else (a bug) as INTERNAL without its detail, logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from core.errors import PrimeRLError, grpc_code_name

INTERNAL_DETAILS = "internal error; see the server log"


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The status of ``exc``: its class's code for a ``PrimeRLError`` (or the code it relays), else INTERNAL."""
    return grpc.StatusCode[grpc_code_name(exc)]


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, log: logging.Logger) -> NoReturn:
    """End the call with ``exc``'s status and message (raises ``grpc.aio.AbortError``).

    A ``ResourceExhausted`` with ``retry_after_s`` sends it as ``retry-after-ms`` trailing metadata.
    """
    if isinstance(exc, PrimeRLError):
        details = exc.message
    else:
        log.error("internal error (%s)", type(exc).__name__, exc_info=exc)
        details = INTERNAL_DETAILS
    retry = getattr(exc, "retry_after_s", None)
    trailers = (("retry-after-ms", str(round(retry * 1000))),) if retry is not None else ()
    await context.abort(grpc_status(exc), details, trailers)
    raise AssertionError("context.abort returned")  # it raises AbortError
