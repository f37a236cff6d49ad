"""Per-request state of an HTTP engine stream, and opening one (``StreamContext``).

A stream is parsed one SSE event at a time (``RemoteEngine.read_deltas``); each event becomes a ``Delta``.
Closing an unfinished stream drops the connection, which is how vLLM and TRT-LLM learn that a request
was aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from core.errors import DeadlineExceeded, EngineUnavailable
from core.types import FinishReason, GenerateRequest, Usage

if TYPE_CHECKING:
    from engines.http.base import RemoteEngine

# What a dropped or silent engine stream raises while we read it (see RemoteEngine._raise_stream_failure).
STREAM_FAILURES = (httpx.StreamError, httpx.ReadError, httpx.RemoteProtocolError, httpx.TimeoutException)


@dataclass(slots=True)
class StreamState:
    """Per-request parsing state (cumulative streams need what was seen before)."""

    request: GenerateRequest
    seen_tokens: int = 0
    aborted: bool = False
    admitted: bool = False
    response: httpx.Response | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Delta:
    """What one stream event adds: new tokens, and maybe the finish reason and/or usage."""

    token_ids: list[int]
    logprobs: list[float]
    finish: FinishReason | None = None
    usage: Usage | None = None


class StreamContext:
    """``async with``: open the generation stream (with connect retries) and check its status."""

    def __init__(self, engine: RemoteEngine, payload: dict[str, Any], deadline: float | None = None) -> None:
        self.engine = engine
        self.payload = payload
        self.deadline = deadline
        self.response: httpx.Response | None = None

    async def __aenter__(self) -> httpx.Response:
        async with asyncio.timeout_at(self.deadline):  # TimeoutError: the turn's deadline passed
            return await self._open()

    async def _open(self) -> httpx.Response:
        e = self.engine

        def send() -> Awaitable[httpx.Response]:
            request = e._client.build_request("POST", e.generate_path, json=self.payload, timeout=e._stream_timeout)
            return e._client.send(request, stream=True)

        try:
            self.response = response = await e.connect(send)
        except httpx.TimeoutException:
            raise DeadlineExceeded(f"{e.label} did not start answering within {e._stream_timeout.read} s") from None
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{e.label} failed before streaming: {exc or type(exc).__name__}") from None
        if response.status_code != 200:
            try:
                body = (await response.aread()).decode("utf-8", "replace")
            except httpx.HTTPError:
                body = ""
            finally:
                await response.aclose()
            raise e.http_error(response.status_code, body, f"POST {e.generate_path}")
        return response

    async def __aexit__(self, *exc_info: object) -> None:
        if self.response is not None:
            # Closing an unfinished stream drops the connection: that is how vLLM and TRT-LLM
            # learn that the client went away and abort the request.
            await self.response.aclose()
