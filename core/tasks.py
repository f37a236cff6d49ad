"""Owning background tasks: the one way a package here stops a task it started.

``core`` is the lowest layer, so every package may use it (the cache's load board, the fleet member's loop, the
inspector's writer, engines' schedulers).
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.5
"""How long ``cancel_and_wait`` waits before it cancels a task again that is still running."""


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended.

    A task still running ``RECANCEL_S`` after its cancellation is cancelled again, and so on: a library may turn a
    cancellation into an error the task handles (on Python 3.11, a cancel that lands as a Redis call's own timeout
    expires came back as redis' ``TimeoutError``; the load board's loop caught it and went on, and the bridge's
    shutdown waited for it forever, until SIGKILL).

    The task's own cancellation (or failure) is not re-raised here; a cancellation of the caller is
    (``asyncio.wait`` propagates it), so a shutdown that is itself cancelled is never swallowed.
    """
    if task is None:
        return
    task.cancel()
    while not (await asyncio.wait([task], timeout=RECANCEL_S))[0]:
        task.cancel()
    if not task.cancelled():
        task.exception()  # retrieved: a failure the task logged itself is not reported again at exit
