"""Load board: bridges share their per-replica in-flight tokens through Redis.

Each bridge sees only the turns it routes; with N bridges each would see ~1/N of the load,
its balance thresholds would rarely trip and a replica hot fleet-wide could keep receiving
turns (SMG #1621). Every ``period_s`` a bridge publishes its own vector
(``ns:load:<bridge>``, expiring after ``ttl_s``, so a crashed bridge's load disappears) and
reads the others' in the same Lua call; their sum becomes the ``remote`` vector of the
bridge's replica set (``placement.routing.ReplicaSet``).
On a Redis error ``remote`` is zeroed (routing on this bridge's own load only) and the
failure counted; the next period retries. (The fleet simulator's in-process equivalent is
``bench/fleet_sim/loadboard.py``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Protocol

from redis.exceptions import RedisError

from cache.redis_index import RedisIndex
from core.tasks import cancel_and_wait

log = logging.getLogger("primerl.cache")

# ARGV: ns, bridge id, now_ms, ttl_ms, vector  -> the other live bridges' vectors
_SYNC = """
local ns, me, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('SET', ns .. ':load:' .. me, ARGV[5], 'PX', ttl)
redis.call('ZADD', ns .. ':bridges', now, me)
redis.call('ZREMRANGEBYSCORE', ns .. ':bridges', '-inf', now - ttl)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', ns .. ':bridges', 0, -1)) do
  if id ~= me then
    local v = redis.call('GET', ns .. ':load:' .. id)
    if v then table.insert(out, v) end
  end
end
return out
"""


class LoadTarget(Protocol):
    load: list[int]
    remote: list[int]


class RedisLoadBoard:
    """Publishes ``target.load`` and fills ``target.remote`` every ``period_s`` (a named, owned task)."""

    def __init__(self, index: RedisIndex, target: LoadTarget, period_s: float = 0.02, ttl_s: float = 2.0) -> None:
        self.index = index
        self.target = target
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.bridge_id = uuid.uuid4().hex[:12]
        self.errors = 0
        self.syncs = 0
        self._script = index.redis.register_script(_SYNC)
        self._task: asyncio.Task[None] | None = None

    async def sync_once(self) -> None:
        vec = ",".join(str(x) for x in self.target.load)
        args: list[str | int] = [self.index.ns, self.bridge_id, f"{time.time() * 1e3:.0f}", int(self.ttl_s * 1e3), vec]
        n = len(self.target.load)
        try:
            async with asyncio.timeout(max(self.period_s, 0.05)):
                others = await self._script(keys=[], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.errors += 1
            self.target.remote = [0] * n
            log.debug("load board sync failed: %r", exc)
            return
        total = [0] * n
        for raw in others:
            for i, x in enumerate(raw.split(b",")[:n]):
                total[i] += int(x)
        self.target.remote = total
        self.syncs += 1

    async def _run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prefix-index-load-board")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
