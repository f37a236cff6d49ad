"""Generation streams of one HTTP engine replica: opening them, reading their events, mapping their failures.

``StreamReader`` holds the client it streams over (the replica's connection pool, which ``RemoteEngine`` creates,
shares with its control calls and closes) and the stream timeout. ``open`` is an ``async with`` that sends the
generation request (connect retries: ``engines.http.edge``) and checks its status; ``events`` yields the stream's
decoded events one SSE event at a time, up to ``[DONE]``. Each engine turns an event into a ``Delta``
(``RemoteEngine.parse_event``) and keeps what it must remember across events in a ``StreamState``.

Invariants
----------
* An engine's ``{"error": ...}`` event, a dropped stream (``EngineUnavailable``) and silence beyond the read
  timeout (``DeadlineExceeded``) raise, naming the replica; a stream dropped after an abort we asked for just ends.
* Closing an unfinished stream drops the connection, which is how vLLM and TRT-LLM learn that a request
  was aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from core.errors import DeadlineExceeded, EngineUnavailable, PrimeRLError
from core.types import FinishReason, GenerateRequest, Usage
from engines.config import RemoteEngineConfig
from engines.http import edge as http_edge
from engines.http.wire import Wire, iter_sse

# What a dropped or silent engine stream raises while we read it (see StreamReader._raise_failure).
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


class StreamReader:
    """Opens and reads one replica's generation streams over ``client`` (module docstring).

    ``http_error(status, body, what)`` maps an HTTP answer to the error tree (the engine's: it knows the
    served model's current limits).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: RemoteEngineConfig,
        *,
        path: str,
        timeout: httpx.Timeout,
        label: str,
        wire: Wire,
        http_error: Callable[[int, str, str], PrimeRLError],
    ) -> None:
        self.client = client
        self.config = config
        self.path = path
        self.timeout = timeout
        self.label = label
        self.wire = wire
        self._http_error = http_error

    def open(self, payload: dict[str, Any], deadline: float | None = None) -> StreamContext:
        """``async with reader.open(payload, deadline) as response``: the open stream, closed on leaving."""
        return StreamContext(self, payload, deadline)

    async def send(self, payload: dict[str, Any]) -> httpx.Response:
        """POST ``payload`` as a stream (with connect retries); a status other than 200 raises a mapped error."""

        def send() -> Awaitable[httpx.Response]:
            request = self.client.build_request("POST", self.path, json=payload, timeout=self.timeout)
            return self.client.send(request, stream=True)

        try:
            response = await http_edge.connect(send, self.config, self.label)
        except httpx.TimeoutException:
            raise DeadlineExceeded(f"{self.label} did not start answering within {self.timeout.read} s") from None
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{self.label} failed before streaming: {exc or type(exc).__name__}") from None
        if response.status_code != 200:
            try:
                body = (await response.aread()).decode("utf-8", "replace")
            except httpx.HTTPError:
                body = ""
            finally:
                await response.aclose()
            raise self._http_error(response.status_code, body, f"POST {self.path}")
        return response

    async def events(
        self, response: httpx.Response, deadline: float, state: StreamState, produced: Callable[[], int]
    ) -> AsyncGenerator[Any, None]:
        """The decoded events of one token stream up to ``[DONE]``; engine errors and dropped or silent streams
        raise (``produced()``: tokens so far, for the message), except after an abort we asked for."""
        lines = iter_sse(response)
        try:
            while True:
                async with asyncio.timeout_at(deadline):  # not held across the yield (it would cancel the consumer)
                    text = await anext(lines, None)
                if text is None or text.strip() == "[DONE]":
                    return
                data = self.wire.loads(text, "stream event")
                if isinstance(data, dict) and data.get("error"):
                    status, body = http_edge.stream_error_status(data["error"])
                    raise self._http_error(status, body, f"the stream after {produced()} tokens")
                yield data
        except STREAM_FAILURES as exc:
            self._raise_failure(exc, state, produced())
        finally:
            await lines.aclose()

    def _raise_failure(self, exc: BaseException, state: StreamState, produced: int) -> None:
        """Map a broken or silent token stream to our errors (an abort we asked for is not a failure)."""
        if isinstance(exc, httpx.TimeoutException):
            raise DeadlineExceeded(
                f"{self.label} sent nothing for {self.timeout.read} s "
                f"(engine.request_timeout_s) after {produced} tokens"
            ) from None
        if not state.aborted:
            raise EngineUnavailable(
                f"{self.label} dropped the stream after {produced} tokens: {exc or type(exc).__name__}"
            ) from None


class StreamContext:
    """``async with``: open the generation stream within ``deadline`` and close it on leaving."""

    def __init__(self, reader: StreamReader, payload: dict[str, Any], deadline: float | None = None) -> None:
        self.reader = reader
        self.payload = payload
        self.deadline = deadline
        self.response: httpx.Response | None = None

    async def __aenter__(self) -> httpx.Response:
        async with asyncio.timeout_at(self.deadline):  # TimeoutError: the turn's deadline passed
            self.response = await self.reader.send(self.payload)
            return self.response

    async def __aexit__(self, *exc_info: object) -> None:
        if self.response is not None:
            # Closing an unfinished stream drops the connection: that is how vLLM and TRT-LLM
            # learn that the client went away and abort the request.
            await self.response.aclose()
