"""The network edge of the HTTP engine adapters: connect retries, URL redaction, and the map from an engine's
HTTP answer to an ``core.errors`` class naming the engine and replica.

Invariants
----------
* Retries happen only here and only when no connection could be opened (so nothing was sent): bounded
  by ``connect_retries`` attempts *and* ``retry_budget_s``. A generation request that reached the engine
  is never sent twice.
* Errors name the engine and replica: unreachable / 5xx / dropped stream -> ``EngineUnavailable``;
  400/422 -> ``InvalidArgument`` (or ``TokenOutOfVocabulary`` when the engine names an out-of-vocabulary
  id); 408/504 -> ``DeadlineExceeded``; a missing endpoint -> ``Unimplemented``.
* Replica labels (in every error and log line) never carry URL userinfo, query or fragment.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from core.errors import (
    DeadlineExceeded,
    EngineUnavailable,
    InvalidArgument,
    PrimeRLError,
    TokenOutOfVocabulary,
    Unimplemented,
)
from core.types import EngineInfo
from engines.config import RemoteEngineConfig
from engines.http.wire import error_message

_OOV = re.compile(r"out of vocabulary|out-of-vocabulary|outside the vocabulary|invalid token id", re.IGNORECASE)
_TOO_LONG = re.compile(r"context length|maximum model length|max_model_len|too long|exceeds", re.IGNORECASE)


def make_client(url: str, config: RemoteEngineConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """The replica's connection pool: control-call timeouts, bounded connections, never a proxy."""
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(config.control_timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=64),
        transport=transport,
        trust_env=False,  # engine URLs are internal: never route them through a proxy from the environment
    )


def stream_timeout(config: RemoteEngineConfig, request_timeout_s: float) -> httpx.Timeout:
    """A generation stream may be silent for at most ``request_timeout_s``."""
    return httpx.Timeout(
        connect=config.connect_timeout_s,
        read=request_timeout_s,
        write=config.control_timeout_s,
        pool=config.connect_timeout_s,
    )


_EVENT_KEYS = {"kv-events", "kv-events-replay"}


def split_engine_url(url: str) -> tuple[str, str, str]:
    """``engine.urls`` entry -> (base URL, KV-event endpoint, its replay endpoint).

    A replica that publishes KV events names them in the URL's fragment:
    ``http://10.0.0.5:8000#kv-events=tcp://10.0.0.5:5557&kv-events-replay=tcp://10.0.0.5:5558``
    (the fragment never reaches the engine). Without one, both endpoints are "".
    """
    base, _, fragment = url.partition("#")
    base = base.rstrip("/")
    if not fragment:
        return base, "", ""
    try:
        pairs = urllib.parse.parse_qsl(fragment, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise InvalidArgument(f"engine URL {redact_url(base)!r}: unreadable fragment {fragment!r} ({exc})") from exc
    found = dict(pairs)
    unknown = sorted(set(found) - _EVENT_KEYS)
    if unknown or len(found) != len(pairs):
        raise InvalidArgument(
            f"engine URL {redact_url(base)!r}: its fragment may name kv-events= and kv-events-replay= once each, "
            f"got {', '.join(k for k, _ in pairs)}"
        )
    for key, value in found.items():
        if not value.startswith(("tcp://", "ipc://")):
            raise InvalidArgument(f"engine URL {redact_url(base)!r}: {key}={value!r} must be a tcp:// or ipc:// URL")
    if "kv-events-replay" in found and "kv-events" not in found:
        raise InvalidArgument(f"engine URL {redact_url(base)!r}: kv-events-replay= needs kv-events=")
    return base, found.get("kv-events", ""), found.get("kv-events-replay", "")


def redact_url(url: str) -> str:
    """``url`` without userinfo, query and fragment: safe for labels, errors and logs."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<invalid url>"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


async def connect(
    send: Callable[[], Awaitable[httpx.Response]], config: RemoteEngineConfig, label: str
) -> httpx.Response:
    """``send()``, retried with exponential backoff while the engine refuses connections (at most
    ``connect_retries`` times within ``retry_budget_s``); other httpx errors propagate to the caller."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + config.retry_budget_s
    delay = config.retry_backoff_s
    attempt = 0
    while True:
        try:
            return await send()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            attempt += 1
            if attempt > config.connect_retries or loop.time() + delay > give_up_at:
                raise EngineUnavailable(f"{label} is not reachable: {str(exc) or type(exc).__name__}") from None
            await asyncio.sleep(delay)
            delay *= 2


def http_error(label: str, info: EngineInfo, status: int, body: str, what: str) -> PrimeRLError:
    """The error for an HTTP ``status`` with ``body`` from the engine ``label`` serving ``info``."""
    msg = error_message(body) or "(empty body)"
    if status in (400, 422):
        if _OOV.search(msg):
            return TokenOutOfVocabulary(f"{label} rejected a token id (vocabulary size {info.vocab_size}): {msg}")
        if _TOO_LONG.search(msg):
            return InvalidArgument(
                f"{label} rejected the request as too long for its context window of {info.max_model_len} tokens: {msg}"
            )
        return InvalidArgument(f"{label} rejected {what} (HTTP {status}): {msg}")
    if status in (404, 405, 501):
        return Unimplemented(f"{label} does not support {what} (HTTP {status}): {msg}")
    if status in (408, 504):
        return DeadlineExceeded(f"{label} timed out on {what} (HTTP {status}): {msg}")
    return EngineUnavailable(f"{label} failed on {what} (HTTP {status}): {msg}")


def stream_error_status(error: Any) -> tuple[int, str]:
    """The HTTP status and body that an ``{"error": ...}`` event inside a stream stands for (vLLM, SGLang and
    TRT-LLM all send one): its ``code`` when that is an HTTP error status, else 500."""
    body = json.dumps({"error": error})
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return status, body
