"""Server-sent events of a running call: ``data: <json>\\n\\n`` per chunk, errors as an event, then ``[DONE]``.

The call's Steps run in their own task (``Runner.run``), which closes them and releases the session
whatever happens; the event stream only reads its queue. A client that goes away closes the stream,
which cancels the task (the Steps end as ABORT with their partial tokens, as a cancelled gRPC Step does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, Protocol

from starlette.responses import StreamingResponse

from server.http.errors import error_event


class Chunks(Protocol):
    """Turns a choice's progress into events: ``(index, n new tokens)``, ``(index, None)`` when it ends; ``tail``
    gives the events after every choice ended (usage)."""

    def __call__(self, index: int, count: int | None) -> Iterable[dict[str, Any]]: ...

    def tail(self) -> Iterable[dict[str, Any]]: ...


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _events(
    task: asyncio.Task[Any], queue: asyncio.Queue[tuple[int, int | None]], n: int, chunks: Chunks
) -> AsyncIterator[str]:
    try:
        done = 0
        while done < n:
            index, count = await queue.get()
            done += count is None
            for chunk in chunks(index, count):
                yield event(chunk)
        await task  # a bug in the task surfaces here, as an error event
        for chunk in chunks.tail():
            yield event(chunk)
    except Exception as exc:  # noqa: BLE001 - sent to the client as vLLM does: an error event, then [DONE]
        yield error_event(exc)
    finally:
        if not task.done():  # the client went away: stop sampling for it
            task.cancel()
            await asyncio.wait([task])
    yield "data: [DONE]\n\n"


def stream(
    run: Callable[[asyncio.Queue[tuple[int, int | None]]], Coroutine[Any, Any, Any]], n: int, chunks: Chunks,
    headers: dict[str, str],
) -> StreamingResponse:  # fmt: skip
    """The SSE response of a call with ``n`` choices: ``run(queue)`` (``Runner.run``) runs in its own task and
    reports each choice's progress on the queue, which ``chunks`` turns into events."""
    queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
    task = asyncio.create_task(run(queue))
    return StreamingResponse(
        _events(task, queue, n, chunks),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", **headers},
    )
