"""What both stand-ins share: an in-process uvicorn server on a free port, fault switches, helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse

from core.types import AdapterRef, GenerateRequest, SamplingParams, TokenChunk
from engines.base import Engine


@dataclass
class Faults:
    """Misbehaviour on demand; the server really does it (tests flip these, no mocks)."""

    drop_after_tokens: int | None = None
    """Cut the connection (no final chunk, no [DONE]) once this many tokens were streamed."""
    malformed: str = ""
    """``json``: send a stream event that is not JSON; ``field``: send a token id as a string."""
    first_byte_delay_s: float = 0.0
    """Wait this long before answering a generation request (a slow engine)."""
    unhealthy: bool = False
    """/health answers 503."""
    health_delay_s: float = 0.0
    """/health answers only after this long (an engine still loading)."""
    keepalive_stall_s: float = 0.0
    """After the response headers, send only SSE keep-alive comments (every 50 ms) for this long."""


async def keepalive_stall(faults: Faults) -> AsyncIterator[bytes]:
    """The ``keepalive_stall_s`` fault: comments that reset a read timeout but carry no event."""
    loop = asyncio.get_running_loop()
    until = loop.time() + faults.keepalive_stall_s
    while loop.time() < until:
        yield b": keep-alive\n\n"
        await asyncio.sleep(0.05)


class StandinServer:
    """Runs a Starlette app with uvicorn inside the current event loop, on a free port."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="critical", lifespan="off", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(), name="standin-uvicorn")
        for _ in range(500):
            if self._server.started:
                break
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("stand-in server did not start within 5 s")
        sockets = self._server.servers[0].sockets
        self.port = sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 10)


def sse(data: Any) -> bytes:
    """One server-sent event (``data: <json>\\n\\n``); a str is sent as is (``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, allow_nan=False)
    return f"data: {text}\n\n".encode()


def error_json(message: str, status: int = 400, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, **extra}}, status_code=status)


def null_if_inf(x: float) -> float | None:
    """orjson (SGLang) writes NaN/inf as null."""
    return None if not math.isfinite(x) else x


def clamp_inf(x: float) -> float:
    """vLLM and TRT-LLM clamp -inf to -9999.0."""
    return max(x, -9999.0) if not math.isnan(x) else x


async def generate(
    engine: Engine,
    ids: list[int],
    params: SamplingParams,
    rid: str,
    *,
    cache_salt: str = "",
    received: list[GenerateRequest] | None = None,
    adapter: AdapterRef | None = None,
) -> AsyncIterator[TokenChunk]:
    """Run the backing engine; the engine request is aborted if the consumer goes away.

    ``cache_salt`` (what the wire carried) reaches the backing engine, so a KV-caching engine
    behind the stand-in is salted as the real server would be; ``received`` records each
    request handed to the backing engine (tests check what arrived end to end).
    """
    request = GenerateRequest(
        request_id=rid or uuid.uuid4().hex, token_ids=tuple(ids), params=params, cache_salt=cache_salt, adapter=adapter
    )
    if received is not None:
        received.append(request)
    stream = engine.generate(request)
    done = False
    try:
        async for chunk in stream:
            yield chunk
            if chunk.finish_reason is not None:
                done = True
    finally:
        if not done:
            await asyncio.shield(engine.abort(request.request_id))
        await stream.aclose()


def decode(engine: Engine, ids: list[int]) -> str:
    tok = engine.tokenizer
    return tok.decode(ids) if tok is not None else ""
