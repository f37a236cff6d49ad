"""Owning background tasks: the one way a package here stops a task it started.

``engines`` is the lowest layer, so every package may use it (the cache's load board, engines'
schedulers).
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended.

    The task's own cancellation (or failure) is not re-raised here; a cancellation of the caller is
    (``asyncio.wait`` propagates it), so a shutdown that is itself cancelled is never swallowed.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: a failure the task logged itself is not reported again at exit
