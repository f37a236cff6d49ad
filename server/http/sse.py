"""Server-sent events of a running call: ``data: <json>\\n\\n`` per chunk, errors as an event, then ``[DONE]``.

The call's Steps run in their own task (``Runner.run``), which closes them and releases the session
whatever happens; the event stream only reads its queue. A client that goes away closes the stream,
which cancels the task (the Steps end as ABORT with their partial tokens, as a cancelled gRPC Step does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.responses import StreamingResponse

from server.http.errors import error_event

Chunks = Callable[[int, int | None], Iterable[dict[str, Any]]]


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _events(
    task: asyncio.Task[Any], queue: asyncio.Queue[tuple[int, int | None]], n: int, chunks: Chunks,
    tail: Callable[[], Iterable[dict[str, Any]]],
) -> AsyncIterator[str]:  # fmt: skip
    try:
        done = 0
        while done < n:
            index, count = await queue.get()
            done += count is None
            for chunk in chunks(index, count):
                yield event(chunk)
        await task  # a bug in the task surfaces here, as an error event
        for chunk in tail():
            yield event(chunk)
    except Exception as exc:  # noqa: BLE001 - sent to the client as vLLM does: an error event, then [DONE]
        yield error_event(exc)
    finally:
        if not task.done():  # the client went away: stop sampling for it
            task.cancel()
            await asyncio.wait([task])
    yield "data: [DONE]\n\n"


def stream(
    task: asyncio.Task[Any], queue: asyncio.Queue[tuple[int, int | None]], n: int, chunks: Chunks,
    tail: Callable[[], Iterable[dict[str, Any]]], headers: dict[str, str],
) -> StreamingResponse:  # fmt: skip
    """The SSE response of a running call with ``n`` choices."""
    return StreamingResponse(
        _events(task, queue, n, chunks, tail),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", **headers},
    )
