"""The request id of the RPC being served: set once per call, read by logs, traces and engine requests.

``RequestIdInterceptor``-style setting happens in ``server.telemetry`` (the outermost interceptor): the
id is the client's ``x-request-id`` metadata when it sends one, else a fresh random id. It lives in a
``ContextVar``, so everything running for the call (the handler, the bridge, engine adapters) sees it
without passing it along, and the id an operator finds in a log line is the one in the trace and in
the engine's own request log. ``configure_logging`` sets a process's log format, the id on every line.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os

HEADER = "x-request-id"
MAX_LENGTH = 128  # a client's id is used as given up to this length (engines log it; keep lines sane)

_SEQUENCE = itertools.count()
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("primerl_request_id", default="")


def new_request_id(sent: str = "") -> str:
    """The client's id when it sent a usable one, else a fresh one."""
    if sent and len(sent) <= MAX_LENGTH and sent.isprintable():
        return sent
    return os.urandom(16).hex()  # 128 random bits, as uuid4 has, at a third of its cost


def engine_request_id(turn_index: int) -> str:
    """The id of one engine request: ``<call's id>-<turn>-<n>``.

    The turn tells the turns of one env Step apart; ``n`` (a counter of this process) makes the id unique even
    when clients send the same ``x-request-id`` on concurrent calls, since engines key their requests by it.
    """
    rid = current_request_id.get() or os.urandom(16).hex()  # "" outside an RPC (tests driving the bridge directly)
    return f"{rid}-{turn_index}-{next(_SEQUENCE)}"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every log record (``-`` outside an RPC), for ``%(request_id)s`` in formats."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True


def configure_logging(level: str, tag: str = "") -> None:
    """The bridge's log format (``tag``: what names this process, e.g. a bridge worker's index)."""
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s {tag}%(name)s [%(request_id)s]: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())  # every record gets the request id of the RPC it was logged in
