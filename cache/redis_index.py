"""Redis prefix index shared by any number of bridge processes (redis-py asyncio).

Layout (``ns`` = ``CacheConfig.namespace()``; ``<hash>`` = the block hash as 8 little-endian bytes;
``<bits>`` = log2 ``CacheConfig.index_buckets``; ``prefix(h, k)`` = the first ``k`` bits of ``<hash>``).
Entries are packed so that Redis keeps them in its compact encodings (listpacks: hashes and sorted
sets of at most 128 small entries), about 30 B per (block, replica) entry (bench/cache_index.py):

- ``ns:h<bits>:<prefix(h, bits)>`` HASH  field = ``<hash>``, value = the block record
  (cache/redis_scripts.py): its reuse count ``f`` over all replicas (cost eviction) and its
  holders, each a replica id with, while provisional, its "provisional until" time. When no
  replica holds a reused block (``f`` >= 2) any more, the record stays as a *ghost* (only
  ``f`` and an expiry ``ghost_ttl_s`` ahead) so a returning prefix keeps its history; one-off
  blocks are deleted. Expired ghosts are deleted by later writes (queue ``ns:gq``).
- ``ns:s:<replica>:<prefix(h, k)>`` ZSET member = ``<hash>``, score = eviction priority
  (cache/index.py ``score``, an integer); ``k`` is chosen from the replica's capacity at its first
  write (about 64 entries per bucket) and kept in ``ns:c:<replica>``.
- ``ns:s:<replica>`` ZSET member = a bucket prefix, score = the lowest score in that bucket:
  eviction pops the replica's lowest entry in two steps, in the same order as one sorted set.
- ``ns:c:<replica>`` HASH the cost-eviction clock of that replica (insertions / capacity), its
  entry count and ``k``
- ``ns:a:<key>``    STRING pinned replica of an episode / GRPO group (``SET NX EX``)

(The earlier layout's ``ns:b:*``, ``ns:r:*`` and ``ns:L:*`` keys are not read: after an upgrade the
index refills from new turns, and an older bridge sharing the Redis simply does not see the new
entries.)

Writes (record / confirm / drop / evict) are one Lua script per call, so a replica's bound and its
block hashes never disagree, and run as owned background tasks (a turn never waits on them).
The scripts build block keys from the hashes they are given (one 8-byte-per-hash argument,
cheap to send), so the index needs a standalone Redis or one cluster slot, not Redis Cluster.
Lookups stop at the first block no still-matching replica holds. ``lookup_mode="script"``
(default) does that walk server-side in one Lua call (one round trip); ``"pipeline"`` sends
pipelined ``HGET``s in growing chunks (32, 128, 512 blocks). The near-cache reuses answers
younger than ``near_cache_ttl_s`` (script mode: per chain; pipeline mode: per block), and this
bridge's own writes invalidate them. Writes run in the background, so ``recent`` adds to an answer the blocks
this bridge recorded that had not reached Redis when it was asked (``cache/recent.py``: a burst over one
prefix sees where its first turn went). Every lookup runs under ``lookup_budget_ms``; a
Redis error or a slow lookup returns ``Match(ok=False)`` (load-only routing), is counted in
``stats.fail_open``, and Redis is skipped for ``backoff_s`` after an error (a write over ``write_timeout_ms`` is
given up and counted in ``stats.slow_writes``, like a slow lookup: no backoff). Nothing here
raises to the caller; redis-py reconnects by itself once Redis is back.

Time is wall-clock milliseconds (shared by all bridges; provisional expiry only needs
coarse agreement between hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from cache.config import CacheConfig
from cache.index import IndexStats, Match, SyncOp, horizon
from cache.recent import RecentWrites
from cache.redis_scripts import FORGET, LOOKUP, WRITE, decode, prefix

log = logging.getLogger("primerl.cache")

_CHUNKS = (32, 128, 512)


def _hprefix(config: CacheConfig) -> bytes:
    return f"{config.namespace()}:h{config.index_buckets.bit_length() - 1}:".encode()


def _blob(hashes: Sequence[int]) -> bytes:
    return np.asarray(hashes, dtype="<u8").tobytes()


class RedisIndex:
    """``PrefixIndex`` over a shared Redis (see module docstring)."""

    fail_open_component = "redis"  # ``stats.fail_open`` is exported as primerl_fail_open_total{component="redis"}

    def __init__(
        self,
        url: str,
        config: CacheConfig,
        clock_ms: Callable[[], float] = lambda: time.time() * 1e3,
    ) -> None:
        self.cfg = config
        self.ns = config.namespace()
        self._hb = config.index_buckets.bit_length() - 1
        self._hprefix = _hprefix(config)
        self.clock_ms = clock_ms
        self.stats = IndexStats()
        budget = config.lookup_budget_ms / 1e3
        self.redis = aioredis.Redis.from_url(
            url,
            socket_timeout=max(budget, config.write_timeout_ms / 1e3),
            socket_connect_timeout=max(budget, 0.05),
            # Once, on a new connection, after a connection error: after a Redis restart every pooled connection
            # is dead, and without it each would fail once, each failure putting the index in its backoff. (A
            # Redis that is down refuses the new connection at once: one error, the backoff.)
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        # KV event writes (``sync``) are awaited off the request path: their own connections, a longer timeout.
        self._events_redis = aioredis.Redis.from_url(
            url,
            socket_timeout=config.event_write_timeout_ms / 1e3,
            socket_connect_timeout=config.event_write_timeout_ms / 1e3,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._write = self.redis.register_script(WRITE)
        self._forget = self.redis.register_script(FORGET)
        self._walk = self.redis.register_script(LOOKUP)
        self._answers: OrderedDict[int, tuple[float, Match]] = OrderedDict()  # script mode near-cache
        self._capacity: dict[int, int] = {}
        self._near: OrderedDict[int, tuple[float, tuple[tuple[int, float], ...]]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._down_until = 0.0
        self._entries_estimate = 0
        # Kept past a write's landing as long as an answer asked before it may still be read: a near-cached one,
        # or one whose routing decision awaits pins after it.
        keep_ms = config.near_cache_ttl_s * 1e3 + 4 * config.lookup_budget_ms + 100
        self.recent_writes = RecentWrites(keep_ms, clock_ms)

    # -- helpers ------------------------------------------------------------------------

    def block_key(self, h: int) -> tuple[bytes, bytes]:
        """The hash key and field of block ``h``'s record."""
        member = h.to_bytes(8, "little")
        return self._hprefix + prefix(member, self._hb), member[self._hb // 8 :]

    @staticmethod
    def block_key_of(config: CacheConfig, h: int) -> tuple[bytes, bytes]:
        """``block_key`` of an index with ``config`` (no client needed)."""
        hb = config.index_buckets.bit_length() - 1
        member = h.to_bytes(8, "little")
        return _hprefix(config) + prefix(member, hb), member[hb // 8 :]

    def _failed(self, exc: BaseException, what: str) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.cfg.backoff_s
        log.warning("prefix index: %s failed (%r); failing open for %.1f s", what, exc, self.cfg.backoff_s)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _state(self, replica: int, now: float) -> list[str | int | bytes]:
        """The ARGV every write script starts with (cache/redis_scripts.py ``_STATE``)."""
        if not 0 <= replica < 32767:
            raise ValueError(f"replica id {replica} out of range for the Redis index (0..32766)")
        cap = self._capacity.get(replica, self.cfg.default_capacity_blocks)
        return [replica, f"{now:.0f}", self.ns, self._hb, f"{self.cfg.ghost_ttl_s * 1e3:.0f}", cap]

    async def held(self, replica: int) -> set[int]:
        """Block hashes ``replica`` holds in the index (tests, debugging: reads every bucket)."""
        top = f"{self.ns}:s:{replica}".encode()
        out: set[int] = set()
        for b in cast(list[bytes], await self.redis.zrange(top, 0, -1)):
            members = cast(list[bytes], await self.redis.zrange(top + b":" + b, 0, -1))
            out |= {int.from_bytes(m, "little") for m in members}
        return out

    async def block(self, h: int) -> tuple[int, dict[int, float], float | None] | None:
        """Block ``h``'s record: (reuse count, replica -> provisional-until ms or 0, ghost expiry ms) or None."""
        rec = cast(bytes | None, await self.redis.hget(*self.block_key(h)))
        return decode(rec) if rec is not None else None

    def set_capacity(self, replica: int, blocks: int) -> None:
        self._capacity[replica] = max(1, blocks)

    def entries(self) -> int:
        return self._entries_estimate

    # -- lookup -------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int]) -> Match:
        self.stats.lookups += 1
        hashes = hashes[: self.cfg.max_lookup_blocks]
        if not hashes:
            return Match()
        if self._down():
            self.stats.fail_open += 1
            return Match(ok=False)
        try:
            async with asyncio.timeout(self.cfg.lookup_budget_ms / 1e3):
                if self.cfg.lookup_mode == "script":
                    return await self._lookup_script(hashes)
                return await self._lookup(hashes)
        except TimeoutError:
            self.stats.slow += 1
            self.stats.fail_open += 1
            return Match(ok=False)
        except (RedisError, OSError) as exc:
            self._failed(exc, "lookup")
            self.stats.fail_open += 1
            return Match(ok=False)

    async def _lookup_script(self, hashes: Sequence[int]) -> Match:
        # Near-cache: the answer for the same chain (same tail hash and length) seen recently;
        # GRPO bursts and popular system prompts repeat chains within milliseconds.
        now = self.clock_ms()
        tail = hashes[-1] ^ len(hashes)
        if self.cfg.near_cache_ttl_s > 0:
            item = self._answers.get(tail)
            if item is not None and item[0] >= now:
                self.stats.near_cache_hits += 1
                return item[1]
        raw = await self._walk(keys=[], args=[f"{now:.0f}", self.ns, self._hb, _blob(hashes)])
        self.stats.round_trips += 1
        it = iter(raw[1:])
        match = Match({int(r): int(b) for r, b in zip(it, it, strict=True)}, True, int(raw[0]), now)
        if self.cfg.near_cache_ttl_s > 0 and self.cfg.near_cache_entries > 0:
            self._answers[tail] = (now + self.cfg.near_cache_ttl_s * 1e3, match)
            self._answers.move_to_end(tail)
            while len(self._answers) > self.cfg.near_cache_entries:
                self._answers.popitem(last=False)
        return match

    async def _lookup(self, hashes: Sequence[int]) -> Match:
        now = self.clock_ms()
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        i = 0
        chunk_no = 0
        n = len(hashes)
        while i < n:
            # Leading blocks the near-cache still knows, then one pipelined chunk from Redis.
            rows: list[tuple[tuple[int, float], ...]] = []
            near = self._near_get(hashes[i], now)
            while near is not None:
                rows.append(near)
                self.stats.near_cache_hits += 1
                if i + len(rows) >= n:
                    break
                near = self._near_get(hashes[i + len(rows)], now)
            if not rows:
                size = _CHUNKS[min(chunk_no, len(_CHUNKS) - 1)]
                chunk_no += 1
                part = hashes[i : i + size]
                async with self.redis.pipeline(transaction=False) as pipe:
                    for h in part:
                        pipe.hget(*self.block_key(h))
                    raw = await pipe.execute()
                self.stats.round_trips += 1
                for h, rec in zip(part, raw, strict=True):
                    row = tuple(decode(rec)[1].items())
                    if row:
                        self._near_put(h, row, now)
                    rows.append(row)
            for row in rows:
                live = {r for r, until in row if until == 0.0 or until > now}
                nxt = live if alive is None else alive & live
                for r in (alive or set()) - nxt:
                    matched[r] = i
                alive = nxt
                if not alive:
                    return Match({r: b for r, b in matched.items() if b > 0}, True, i + 1, now)
                i += 1
        for r in alive or ():
            matched[r] = i
        return Match({r: b for r, b in matched.items() if b > 0}, True, n, now)

    def _near_get(self, h: int, now: float) -> tuple[tuple[int, float], ...] | None:
        if self.cfg.near_cache_ttl_s <= 0:
            return None
        item = self._near.get(h)
        if item is None or item[0] < now:
            return None
        return item[1]

    def _near_put(self, h: int, row: tuple[tuple[int, float], ...], now: float) -> None:
        if self.cfg.near_cache_ttl_s <= 0 or self.cfg.near_cache_entries == 0:
            return
        self._near[h] = (now + self.cfg.near_cache_ttl_s * 1e3, row)
        self._near.move_to_end(h)
        while len(self._near) > self.cfg.near_cache_entries:
            self._near.popitem(last=False)

    # -- writes (background) ------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"prefix-index-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_write(self, op: str, replica: int, hashes: Sequence[int]) -> None:
        try:
            if not hashes or self._down():
                if hashes:
                    self.stats.write_errors += 1
                return
            await self._write_now(op, replica, hashes, self.cfg.write_timeout_ms / 1e3)
        except TimeoutError:
            # Slow, like a lookup over its budget: given up and counted, but no backoff. The write is off the
            # request path, and on a busy host its wait is the event loop's as much as Redis's; backing off would
            # fail every lookup open for ``backoff_s`` over one late task (measured: bench/peer_routing.py).
            self.stats.write_errors += 1
            self.stats.slow_writes += 1
        except (RedisError, OSError) as exc:
            self.stats.write_errors += 1
            self._failed(exc, op)
        finally:
            if op == "record":
                self.recent_writes.landed(replica, hashes)

    async def _write_now(
        self, op: str, replica: int, hashes: Sequence[int], timeout_s: float, client: aioredis.Redis | None = None
    ) -> None:
        """One write script call and this bridge's bookkeeping of it; raises what Redis raised."""
        now = self.clock_ms()
        until = "0" if op == "confirm" else f"{int(now + self.cfg.provisional_ttl_s * 1e3)}"
        args = [*self._state(replica, now), self.cfg.eviction, until, op, _blob(hashes)]
        args.append(repr(horizon(self.cfg.capacity_ratio)))
        async with asyncio.timeout(timeout_s):
            evicted = await self._write(keys=[], args=args, client=client)
        self.stats.round_trips += 1
        self.stats.evictions += int(evicted)
        if op == "evict":
            for h in hashes:  # this bridge knows the replica no longer holds them
                item = self._near.get(h)
                if item is not None:
                    self._near[h] = (item[0], tuple(x for x in item[1] if x[0] != replica))
            self._answers.clear()  # a near-cached answer for any chain through these blocks is stale
        elif op != "drop":
            self._entries_estimate += len(hashes) - int(evicted)
            for h in hashes:  # this bridge knows the replica now holds them
                item = self._near.get(h)
                if item is not None:
                    row = (*tuple(x for x in item[1] if x[0] != replica), (replica, float(until)))
                    self._near[h] = (item[0], row)

    async def sync(self, replica: int, op: SyncOp, hashes: Sequence[int] = ()) -> bool:
        """Awaited with ``event_write_timeout_ms`` and tried twice, whatever the fail-open backoff says: a KV
        event write is off the request path, and losing one would make the exact index lie."""
        if op != "forget" and not hashes:
            return True
        if op == "confirm":
            self._invalidate(hashes)
        elif op == "evict":
            self.recent_writes.remove(replica, hashes)
        timeout_s = self.cfg.event_write_timeout_ms / 1e3
        for attempt in (1, 2):
            try:
                if op == "forget":
                    await self._forget_now(replica, timeout_s, self._events_redis)
                else:
                    await self._write_now(op, replica, list(hashes), timeout_s, self._events_redis)
                return True
            except (RedisError, OSError, TimeoutError) as exc:
                self.stats.write_errors += 1
                log.warning("prefix index: kv event %s of replica %d failed (%r), try %d", op, replica, exc, attempt)
        return False

    def _invalidate(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._answers.pop(hashes[-1] ^ len(hashes), None)

    def recent(self, match: Match, hashes: Sequence[int]) -> Match:
        return self.recent_writes.extend(match, hashes)

    async def record(self, replica: int, hashes: Sequence[int]) -> None:
        self._invalidate(hashes)
        self.recent_writes.begin(replica, hashes)
        self._spawn(self._run_write("record", replica, list(hashes)), "record")

    async def confirm(self, replica: int, hashes: Sequence[int]) -> None:
        self._invalidate(hashes)
        self._spawn(self._run_write("confirm", replica, list(hashes)), "confirm")

    async def drop(self, replica: int, hashes: Sequence[int]) -> None:
        self.recent_writes.remove(replica, hashes)
        self._spawn(self._run_write("drop", replica, list(hashes)), "drop")

    async def evict(self, replica: int, hashes: Sequence[int]) -> None:
        self.recent_writes.remove(replica, hashes)
        self._spawn(self._run_write("evict", replica, list(hashes)), "evict")

    async def _forget_now(self, replica: int, timeout_s: float, client: aioredis.Redis | None = None) -> None:
        """Drop every entry of ``replica`` (and this bridge's near-caches); raises what Redis raised."""
        self._near.clear()
        self._answers.clear()
        self.recent_writes.remove(replica)
        async with asyncio.timeout(timeout_s):
            await self._forget(keys=[], args=self._state(replica, self.clock_ms()), client=client)

    async def forget_replica(self, replica: int) -> None:
        try:
            await self._forget_now(replica, self.cfg.write_timeout_ms / 1e3 * 10)
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.write_errors += 1
            self._failed(exc, "forget_replica")

    # -- pins ---------------------------------------------------------------------------

    async def pin(self, key: str, replica: int, ttl_s: float) -> int:
        if self._down():
            self.stats.fail_open += 1
            return replica
        k = f"{self.ns}:a:{key}"
        try:
            async with asyncio.timeout(self.cfg.lookup_budget_ms / 1e3):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(k, replica, nx=True, px=int(ttl_s * 1e3))
                    pipe.get(k)
                    _, cur = await pipe.execute()
            self.stats.round_trips += 1
            return int(cur) if cur is not None else replica
        except TimeoutError:
            self.stats.slow += 1
            self.stats.fail_open += 1
        except (RedisError, OSError) as exc:
            self._failed(exc, "pin")
            self.stats.fail_open += 1
        return replica

    async def pinned(self, key: str) -> int | None:
        if self._down():
            self.stats.fail_open += 1
            return None
        try:
            async with asyncio.timeout(self.cfg.lookup_budget_ms / 1e3):
                cur = await self.redis.get(f"{self.ns}:a:{key}")
            self.stats.round_trips += 1
            return int(cur) if cur is not None else None
        except TimeoutError:
            self.stats.slow += 1
        except (RedisError, OSError) as exc:
            self._failed(exc, "pinned")
        self.stats.fail_open += 1
        return None

    async def unpin(self, key: str) -> None:
        if self._down():
            return
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.cfg.write_timeout_ms / 1e3):
                await self.redis.delete(f"{self.ns}:a:{key}")

    # -- lifecycle ----------------------------------------------------------------------

    async def flush(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        await self.redis.aclose()
        await self._events_redis.aclose()
