"""Synchronous and asynchronous rollout/train scheduling bounded by ``max_async_level``.

The trainer's version ``v`` is the bridge's policy version after its last ``UpdateWeights``; batch ``s``
(0-based, counted from the run's first step) is trained when ``v == base + s``.

Invariants
----------
* Admission: collection of batch ``s`` starts only once ``v >= base + s - max_async_level``, so every
  token it samples carries a version within ``max_async_level`` of the version that trains on it.
  ``max_async_level = 0`` is the synchronous loop (collect, train, update, repeat).
* At most ``max_async_level`` finished batches wait for the trainer (a bounded queue), so rollouts never
  run further ahead than the bound even when training is slow.
* Staleness is still checked at consumption (``grpo.masks.StalenessFilter``) by the train function: the
  admission bound is what the scheduler promises; the filter is what the trainer verifies and counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

B = TypeVar("B")


class Pipeline(Generic[B]):
    """Runs ``collect(step)`` ahead of ``train(step, batch) -> new version`` by at most ``max_async_level``."""

    def __init__(self, max_async_level: int, base_version: int) -> None:
        if max_async_level < 0:
            raise ValueError("max_async_level must be >= 0")
        self.max_async_level = max_async_level
        self.base = base_version
        self.version = base_version
        self._changed = asyncio.Condition()
        self.admitted_at: dict[int, int] = {}  # step -> trainer version when its collection started

    async def _produce(
        self, first: int, last: int, collect: Callable[[int], Awaitable[B]], queue: asyncio.Queue[tuple[int, B]]
    ) -> None:
        for step in range(first, last):
            floor = self.base + step - self.max_async_level
            async with self._changed:
                await self._changed.wait_for(lambda f=floor: self.version >= f)  # type: ignore[misc]
            self.admitted_at[step] = self.version
            batch = await collect(step)
            await queue.put((step, batch))

    async def run(
        self,
        first: int,
        last: int,
        collect: Callable[[int], Awaitable[B]],
        train: Callable[[int, B], Awaitable[int]],
    ) -> None:
        """Steps ``first .. last-1``; ``base_version`` is the version at step ``first``."""
        self.base -= first  # so that step `first` trains at base_version
        queue: asyncio.Queue[tuple[int, B]] = asyncio.Queue(maxsize=max(1, self.max_async_level))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._produce(first, last, collect, queue), name="rollout-producer")
            for _ in range(first, last):
                step, batch = await queue.get()
                new_version = await train(step, batch)
                async with self._changed:
                    self.version = new_version
                    self._changed.notify_all()


__all__ = ["Pipeline"]
