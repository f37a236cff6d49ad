"""``EndedStore``: the inspector's ended episodes in Redis (with ``persistence.enabled``), so a restarted bridge, or
another bridge on the same Redis, still shows the recently ended ones.

Keys, under the journal's ``persistence.key_prefix`` (``P``):
- ``P:inspect:ep:{id}``: a hash of ``tenant``, ``summary`` and ``record`` (``Ended``'s byte strings), TTL
  ``inspector.ended_ttl_s``;
- ``P:inspect:tenant:{tenant}`` (that tenant's) and ``P:inspect:all`` (every tenant's, for admin viewers): sorted
  sets of ended ids scored by end time, trimmed to the TTL and to the newest ``inspector.max_ended_episodes``.

Invariants:
- ``put`` never waits and never raises (the bridge's hooks call it): it queues (bounded) for one owned task,
  ``inspector-redis-writer``; a full queue or a failed or slow write drops those episodes, counts them
  (``dropped``) and logs a warning, once per outage;
- a read takes at most the journal's ``timeout_s`` and raises ``PersistenceUnavailable``: the routes then answer
  from memory;
- a tenant reads only its own sorted set, and each hash's tenant is checked again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from core.tasks import cancel_and_wait
from server.persistence import EpisodeJournal, PersistenceUnavailable

log = logging.getLogger(__name__)

QUEUE = 1024  # ended episodes waiting for the writer; beyond: dropped
BATCH = 64  # episodes per pipelined write
READ_CHUNK = 100  # summaries per pipelined read
ENTRY_OVERHEAD = 400  # bytes an ended entry costs in memory beyond its two byte strings (objects, dict slot), measured


@dataclass(frozen=True, slots=True)
class Ended:
    """An ended episode as the inspector keeps it (in memory and in Redis)."""

    tenant: str
    summary: bytes  # JSON
    record: bytes  # server.persistence.encode

    @property
    def size(self) -> int:
        return len(self.summary) + len(self.record) + ENTRY_OVERHEAD


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class EndedStore:
    """See module docstring."""

    def __init__(self, redis: Any, prefix: str, ttl_s: int, keep: int, timeout_s: float) -> None:
        self.redis, self.ttl_s, self.keep, self.timeout_s = redis, ttl_s, keep, timeout_s
        self._prefix = f"{prefix}:inspect"
        self._queue: asyncio.Queue[tuple[str, float, Ended]] = asyncio.Queue(QUEUE)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._down = False  # a drop was logged; the next good write logs the recovery
        self.dropped = 0

    @classmethod
    def for_journal(cls, journal: EpisodeJournal, ttl_s: int, keep: int) -> EndedStore:
        config = journal.config
        return cls(journal.client, config.key_prefix, ttl_s, keep, config.timeout_s)

    def _ep(self, episode_id: str) -> str:
        return f"{self._prefix}:ep:{episode_id}"

    def _ids(self, tenant: str | None) -> str:
        return f"{self._prefix}:all" if tenant is None else f"{self._prefix}:tenant:{tenant}"

    # -- writes (off the hot path) --------------------------------------------------------------------------------

    def put(self, episode_id: str, ended_at: float, entry: Ended) -> None:
        """Queue an ended episode for Redis; never waits, never raises."""
        if self._closed or self.keep == 0:
            return
        if self._task is None:
            try:
                self._task = asyncio.get_running_loop().create_task(self._run(), name="inspector-redis-writer")
            except RuntimeError:  # no event loop (a hook called outside the bridge): nothing can write
                self._drop(1, "no event loop runs the writer")
                return
        try:
            self._queue.put_nowait((episode_id, ended_at, entry))
        except asyncio.QueueFull:
            self._drop(1, f"{QUEUE} ended episodes already wait for Redis (slow or down)")

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        if not self._down:
            self._down = True
            log.warning("inspector: ended episodes not kept in Redis (%s); dropping them until it answers", why)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._write(batch)
            except Exception as exc:  # noqa: BLE001 - whatever a write raises, the writer goes on (the page is best effort)
                self._drop(len(batch), f"{type(exc).__name__}: {exc}")
            else:
                if self._down:
                    self._down = False
                    log.info("inspector: Redis answers again; %d ended episodes were dropped so far", self.dropped)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[tuple[str, float, Ended]]) -> None:
        oldest = time.time() - self.ttl_s
        async with asyncio.timeout(self.timeout_s), self.redis.pipeline(transaction=False) as pipe:
            sets = {self._ids(None)}
            for episode_id, ended_at, entry in batch:
                key = self._ep(episode_id)
                pipe.hset(key, mapping={"tenant": entry.tenant, "summary": entry.summary, "record": entry.record})
                pipe.expire(key, self.ttl_s)
                sets.add(self._ids(entry.tenant))
                for ids in (self._ids(None), self._ids(entry.tenant)):
                    pipe.zadd(ids, {episode_id: ended_at})
            for ids in sorted(sets):
                pipe.zremrangebyscore(ids, "-inf", oldest)
                pipe.zremrangebyrank(ids, 0, -(self.keep + 1))
                pipe.expire(ids, self.ttl_s)
            await pipe.execute()

    async def close(self) -> None:
        """Write what is queued (for at most ``timeout_s``), then end the writer; later ``put``s are ignored."""
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._queue.join()
        except TimeoutError:
            self._drop(self._queue.qsize(), "the bridge stopped before Redis took them")
        await cancel_and_wait(task)

    # -- reads (awaited by the routes, bounded by timeout_s) -------------------------------------------------------

    async def _read(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.timeout_s):
                return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            raise PersistenceUnavailable(f"inspector: cannot {what} in Redis: {exc or 'timed out'}") from None

    async def get(self, episode_id: str) -> Ended | None:
        """An ended episode Redis keeps (any tenant's: the caller checks ``tenant``)."""
        fields = self.redis.hmget(self._ep(episode_id), "tenant", "summary", "record")
        tenant, summary, record = await self._read("read an ended episode", fields)
        if tenant is None or summary is None or record is None:
            return None
        return Ended(_text(tenant), bytes(summary), bytes(record))

    async def recent(
        self, tenant: str | None, skip: Collection[str], limit: int, match: Callable[[dict[str, Any]], bool]
    ) -> list[dict[str, Any]]:
        """Summaries, newest first, of the ended episodes Redis keeps for ``tenant`` (None: every tenant's) that are
        not in ``skip`` and ``match``: at most ``limit``."""
        return await self._read("list ended episodes", self._recent(tenant, skip, limit, match))

    async def _recent(
        self, tenant: str | None, skip: Collection[str], limit: int, match: Callable[[dict[str, Any]], bool]
    ) -> list[dict[str, Any]]:
        ids = [i for i in map(_text, await self.redis.zrevrange(self._ids(tenant), 0, self.keep - 1)) if i not in skip]
        rows: list[dict[str, Any]] = []
        for start in range(0, len(ids), READ_CHUNK):
            async with self.redis.pipeline(transaction=False) as pipe:
                for episode_id in ids[start : start + READ_CHUNK]:
                    pipe.hmget(self._ep(episode_id), "tenant", "summary")
                found = await pipe.execute()
            for owner, summary in found:
                if summary is None or (tenant is not None and _text(owner) != tenant):
                    continue  # expired since, or (never) another tenant's
                row: dict[str, Any] = json.loads(summary)
                if match(row):
                    rows.append(row)
                    if len(rows) >= limit:
                        return rows
        return rows
