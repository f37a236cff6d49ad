"""core.tasks.cancel_and_wait: a background task stops even when something inside it swallows the cancellation."""

from __future__ import annotations

import asyncio

import pytest

from core import tasks
from core.tasks import cancel_and_wait


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the load board's loop did on Python 3.11: a cancellation came back out of a Redis call as redis'
    TimeoutError, the loop counted it and slept again, and the bridge's shutdown waited forever (SIGKILLed by the
    tests' 20 s teardown)."""
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)  # a Redis call
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # turned into an error the loop handles: it goes on

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 5)  # before the fix: cancelled once, waited for forever
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_ends_on_its_first_cancellation_is_not_cancelled_again() -> None:
    ends: list[str] = []

    async def loop() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ends.append("cancelled")
            await asyncio.sleep(0.01)  # its cleanup awaits, not interrupted
            ends.append("cleaned up")
            raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert ends == ["cancelled", "cleaned up"] and task.cancelled()


async def test_a_task_that_failed_or_is_none_is_waited_for_without_raising() -> None:
    async def fail() -> None:
        raise RuntimeError("it logged this itself")

    task = asyncio.create_task(fail())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    await cancel_and_wait(None)
    assert isinstance(task.exception(), RuntimeError)
