"""Redis prefix index shared by any number of bridge processes (redis-py asyncio).

Layout (``ns`` = ``CacheConfig.namespace()``; ``<hash>`` = the block hash as 8 little-endian bytes):

- ``ns:b:<hash>``   HASH  field = replica id, value = ``"<hits>:<provisional_until_ms>"`` (0 = confirmed);
  with cost eviction also field ``f`` = the block's reuse count over all replicas. When no
  replica holds a reused block (``f`` >= 2) any more, the key stays, holding only ``f``, for
  ``ghost_ttl_s`` (PEXPIRE; PERSIST when a replica takes it again), so a returning prefix
  keeps its history; one-off blocks are deleted.
- ``ns:r:<replica>`` ZSET member = ``<hash>``, score = eviction priority (cache/index.py ``score``)
- ``ns:L:<replica>`` STRING the cost-eviction clock of that replica (insertions / capacity)
- ``ns:a:<key>``    STRING pinned replica of an episode / GRPO group (``SET NX EX``)

Writes (record / confirm / drop) are one Lua script per call, so a replica's bound and its
block hashes never disagree, and run as owned background tasks (a turn never waits on them).
The scripts build block keys from the hashes they are given (one 8-byte-per-hash argument,
cheap to send), so the index needs a standalone Redis or one cluster slot, not Redis Cluster.
Lookups stop at the first block no still-matching replica holds. ``lookup_mode="script"``
(default) does that walk server-side in one Lua call (one round trip); ``"pipeline"`` sends
pipelined ``HGETALL``s in growing chunks (32, 128, 512 blocks). The near-cache reuses answers
younger than ``near_cache_ttl_s`` (script mode: per chain; pipeline mode: per block), and this
bridge's own writes invalidate them. Every lookup runs under ``lookup_budget_ms``; a
Redis error or a slow lookup returns ``Match(ok=False)`` (load-only routing), is counted in
``stats.fail_open``, and Redis is skipped for ``backoff_s`` after an error. Nothing here
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
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cache.config import CacheConfig
from cache.index import CHAIN_EPS, IndexStats, Match, horizon

log = logging.getLogger("primerl.cache")

# KEYS: zset, clock  ARGV: replica, now_ms, mode, cap, block_size, until_ms, op, ns, hashes (8 B LE each),
#   horizon, ghost_ttl_ms, chain_eps.  Same arithmetic, in the same order, as MemoryIndex._write.
_WRITE = """
local zkey, lkey = KEYS[1], KEYS[2]
local rep, now, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local cap, bs, untl, op, ns = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local reuse_cap, ghost_ms, eps = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local clock = tonumber(redis.call('GET', lkey) or '0')
local blob = ARGV[9]
local n = #blob / 8
local function unheld(key)
  if redis.call('HLEN', key) == 1 then
    local f = tonumber(redis.call('HGET', key, 'f'))
    if f == nil then return end
    if f >= 2 then redis.call('PEXPIRE', key, ghost_ms) else redis.call('DEL', key) end
  end
end
if op == 'drop' then
  for i = 0, n - 1 do
    local member = string.sub(blob, 8 * i + 1, 8 * i + 8)
    local key = ns .. ':b:' .. member
    local v = redis.call('HGET', key, rep)
    if v and string.match(v, ':(%d+)$') ~= '0' then
      redis.call('HDEL', key, rep)
      redis.call('ZREM', zkey, member)
      unheld(key)
    end
  end
  return 0
end
local floor = nil
for i = n - 1, 0, -1 do
  local member = string.sub(blob, 8 * i + 1, 8 * i + 8)
  local key = ns .. ':b:' .. member
  local v = redis.call('HGET', key, rep)
  local hits, p = 0, untl
  if v then
    local a, b = string.match(v, '(%d+):(%d+)')
    hits, p = tonumber(a), b
  end
  local bump = (op == 'record') or (not v)
  if op == 'confirm' then p = '0' elseif v and p ~= '0' then p = untl end
  if bump then hits = hits + 1 end
  redis.call('HSET', key, rep, string.format('%d', hits) .. ':' .. p)
  if mode == 'lru' then
    if bump then redis.call('ZADD', zkey, 'GT', now / 1000.0 + (n - i) * 1e-6, member) end
  else
    local s = nil
    if v then
      s = tonumber(redis.call('ZSCORE', zkey, member))
    else
      clock = clock + 1 / cap
      redis.call('PERSIST', key)
    end
    if bump then
      local f = redis.call('HINCRBY', key, 'f', 1)
      local holders = redis.call('HLEN', key) - 1
      local x = clock + math.min(f / math.max(1, holders), reuse_cap) - 1
      if s == nil or x > s then s = x end
    end
    if s == nil then s = clock - 1 end  -- held but missing from the ZSET (cannot happen via these scripts)
    if floor ~= nil and floor > s then s = floor end
    redis.call('ZADD', zkey, s, member)
    floor = s + eps
  end
end
local cnt = redis.call('ZCARD', zkey)
local evicted = 0
if cnt > cap then
  local popped = redis.call('ZPOPMIN', zkey, cnt - cap)
  for j = 1, #popped, 2 do
    local key = ns .. ':b:' .. popped[j]
    redis.call('HDEL', key, rep)
    unheld(key)
    evicted = evicted + 1
  end
end
if mode == 'cost' then redis.call('SET', lkey, string.format('%.17g', clock)) end
return evicted
"""

# ARGV: now_ms, ns, hashes (8 B LE each)  -> {blocks examined, replica, matched, replica, matched, ...}
_LOOKUP = """
local now = tonumber(ARGV[1])
local prefix = ARGV[2] .. ':b:'
local blob = ARGV[3]
local alive = nil
local matched = {}
local examined = 0
for i = 1, #blob / 8 do
  examined = i
  local f = redis.call('HGETALL', prefix .. string.sub(blob, 8 * i - 7, 8 * i))
  local live = {}
  local any = false
  for j = 1, #f, 2 do
    local p = f[j] ~= 'f' and tonumber(string.match(f[j + 1], ':(%d+)$'))
    if p and (p == 0 or p > now) and (alive == nil or alive[f[j]]) then
      live[f[j]] = true
      any = true
    end
  end
  if alive ~= nil then
    for r, _ in pairs(alive) do
      if not live[r] then matched[r] = i - 1 end
    end
  end
  alive = live
  if not any then break end
end
if alive ~= nil then
  for r, _ in pairs(alive) do matched[r] = examined end
end
local out = {examined}
for r, b in pairs(matched) do
  if b > 0 then
    table.insert(out, tonumber(r))
    table.insert(out, b)
  end
end
return out
"""

# KEYS: zset  ARGV: replica, ns, ghost_ttl_ms  -- remove every entry of a replica
_FORGET = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, m in ipairs(members) do
  local key = ARGV[2] .. ':b:' .. m
  redis.call('HDEL', key, ARGV[1])
  if redis.call('HLEN', key) == 1 then
    local f = tonumber(redis.call('HGET', key, 'f'))
    if f ~= nil and f >= 2 then redis.call('PEXPIRE', key, ARGV[3]) elseif f ~= nil then redis.call('DEL', key) end
  end
end
redis.call('DEL', KEYS[1])
return #members
"""

_CHUNKS = (32, 128, 512)


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
        self._bprefix = f"{self.ns}:b:".encode()
        self.clock_ms = clock_ms
        self.stats = IndexStats()
        budget = config.lookup_budget_ms / 1e3
        self.redis = aioredis.Redis.from_url(
            url,
            socket_timeout=max(budget, config.write_timeout_ms / 1e3),
            socket_connect_timeout=max(budget, 0.05),
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._write = self.redis.register_script(_WRITE)
        self._forget = self.redis.register_script(_FORGET)
        self._walk = self.redis.register_script(_LOOKUP)
        self._answers: OrderedDict[int, tuple[float, Match]] = OrderedDict()  # script mode near-cache
        self._capacity: dict[int, int] = {}
        self._near: OrderedDict[int, tuple[float, tuple[tuple[int, float], ...]]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._down_until = 0.0
        self._entries_estimate = 0

    # -- helpers ------------------------------------------------------------------------

    def _bkey(self, h: int) -> bytes:
        return self._bprefix + h.to_bytes(8, "little")

    def _failed(self, exc: BaseException, what: str) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.cfg.backoff_s
        log.warning("prefix index: %s failed (%r); failing open for %.1f s", what, exc, self.cfg.backoff_s)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

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
        raw = await self._walk(keys=[], args=[f"{now:.0f}", self.ns, _blob(hashes)])
        self.stats.round_trips += 1
        it = iter(raw[1:])
        match = Match({int(r): int(b) for r, b in zip(it, it, strict=True)}, True, int(raw[0]))
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
                        pipe.hgetall(self._bkey(h))
                    raw = await pipe.execute()
                self.stats.round_trips += 1
                for h, fields in zip(part, raw, strict=True):
                    row = tuple((int(k), float(v.split(b":", 1)[1])) for k, v in fields.items() if k != b"f")
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
                    return Match({r: b for r, b in matched.items() if b > 0}, True, i + 1)
                i += 1
        for r in alive or ():
            matched[r] = i
        return Match({r: b for r, b in matched.items() if b > 0}, True, n)

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
        if not hashes or self._down():
            if hashes:
                self.stats.write_errors += 1
            return
        now = self.clock_ms()
        until = "0" if op == "confirm" else f"{int(now + self.cfg.provisional_ttl_s * 1e3)}"
        cap = self._capacity.get(replica, self.cfg.default_capacity_blocks)
        keys = [f"{self.ns}:r:{replica}", f"{self.ns}:L:{replica}"]
        args: list[str | int | bytes] = [replica, f"{now:.0f}", self.cfg.eviction, cap, self.cfg.block_size, until, op]
        args += [
            self.ns,
            _blob(hashes),
            repr(horizon(self.cfg.capacity_ratio)),
            f"{self.cfg.ghost_ttl_s * 1e3:.0f}",
            repr(CHAIN_EPS),
        ]
        try:
            async with asyncio.timeout(self.cfg.write_timeout_ms / 1e3):
                evicted = await self._write(keys=keys, args=args)
            self.stats.round_trips += 1
            self.stats.evictions += int(evicted)
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.write_errors += 1
            self._failed(exc, op)
            return
        if op != "drop":
            self._entries_estimate += len(hashes) - int(evicted)
            for h in hashes:  # this bridge knows the replica now holds them
                item = self._near.get(h)
                if item is not None:
                    row = (*tuple(x for x in item[1] if x[0] != replica), (replica, float(until)))
                    self._near[h] = (item[0], row)

    def _invalidate(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._answers.pop(hashes[-1] ^ len(hashes), None)

    async def record(self, replica: int, hashes: Sequence[int]) -> None:
        self._invalidate(hashes)
        self._spawn(self._run_write("record", replica, list(hashes)), "record")

    async def confirm(self, replica: int, hashes: Sequence[int]) -> None:
        self._invalidate(hashes)
        self._spawn(self._run_write("confirm", replica, list(hashes)), "confirm")

    async def drop(self, replica: int, hashes: Sequence[int]) -> None:
        self._spawn(self._run_write("drop", replica, list(hashes)), "drop")

    async def forget_replica(self, replica: int) -> None:
        self._near.clear()
        self._answers.clear()
        try:
            async with asyncio.timeout(self.cfg.write_timeout_ms / 1e3 * 10):
                ghost_ms = f"{self.cfg.ghost_ttl_s * 1e3:.0f}"
                await self._forget(keys=[f"{self.ns}:r:{replica}"], args=[replica, self.ns, ghost_ms])
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
