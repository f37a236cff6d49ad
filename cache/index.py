"""Prefix index: which replica holds which prefix block, behind one async protocol.

An entry says "replica r holds block h" (h = a chained block hash, cache/fingerprint.py, so
holding h means holding the whole prefix up to it). Entries are written **provisionally** at
routing time (the engine is about to compute them) and **confirmed** by what the engine
reports after the turn (cached-token counts; the prompt blocks are then in its KV). A
provisional entry not confirmed within ``provisional_ttl_s`` is ignored by lookups; ``drop``
removes provisional entries of a turn that failed before prefill.

Per replica the index holds at most ``capacity`` entries (sized to that replica's KV cache).
Eviction scores (same formulas, same order of float operations, in the memory and Redis backends):

- ``cost`` (GDSF-style, aged by volume): ``clock + min(reuse / holders, horizon) - 1``.
  ``reuse`` = routed requests that used the block, counted per *block hash* over all
  replicas and, once reused, remembered for ``ghost_ttl_s`` after the last replica lets it
  go (a "ghost", as in ARC / TinyLFU): a system or GRPO prompt squeezed out by a burst of
  one-off prompts comes back with its history instead of starting again at 1. ``holders`` =
  replicas holding it (a copy held elsewhere too is worth less: dropping it recomputes
  nothing). ``clock`` = the replica's insertions / capacity (capacity turnovers), so a
  one-off block lives about one turnover (as in LRU) and a block reused ``x`` times per copy
  about ``x``, at most ``horizon(capacity_ratio)`` = KV capacity / index bound (<= 16): the
  engine's own LRU keeps an unused block about that long, and an entry kept longer would
  point at evicted KV. With the index as large as the KV this is LRU plus the copy and chain
  rules. Every block saves ``block_size`` tokens and costs the same bytes, so per block
  "prefill tokens saved x hits / bytes" is proportional to ``reuse / holders``. A parent
  always scores above its children: a chain is evicted from its tail (dropping a parent
  first would strand its children, as lookups stop at the first miss).
- ``lru``: last-use time (parents a hair newer than children, as engines evict tails first).

Lookups walk the chain from block 0 and stop at the first block no replica still matching
holds; ``Match.blocks[r]`` is the number of leading blocks replica r holds. A backend that
cannot answer (Redis down, over budget) returns ``Match(ok=False)``: routing then uses load
only. Never raises for index trouble; counts it in ``IndexStats``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Eviction = Literal["cost", "lru"]
BYTES_PER_ENTRY = 24  # notional: 8 B hash + 8 B replica/state + 8 B score (what a compact store needs)
SyncOp = Literal["confirm", "evict", "forget"]  # what a replica's KV events write (PrefixIndex.sync)
REUSE_CAP = 16.0  # cost eviction: a block outlives a one-off by at most REUSE_CAP - 1 capacity turnovers
SCORE_UNITS = 1_000_000.0  # scores are integers: priorities in millionths (compact in Redis, cache/redis_scripts.py)
CHAIN_EPS = 1.0  # cost eviction: a parent scores at least one unit above its child


@dataclass(frozen=True, slots=True)
class Match:
    """Result of one lookup: leading blocks held per replica (replicas with none are absent)."""

    blocks: dict[int, int] = field(default_factory=dict)
    ok: bool = True  # False: the index gave no information (fail open to load-only routing)
    looked_up: int = 0  # blocks examined
    asked_ms: float = 0.0  # when the backend was asked (its clock): writes landed later are not in the answer

    def tokens(self, replica: int, block_size: int) -> int:
        return self.blocks.get(replica, 0) * block_size


@dataclass(slots=True)
class IndexStats:
    """Counters a bridge exports as metrics (all monotone)."""

    lookups: int = 0
    fail_open: int = 0  # lookups answered "no information" (errors, budget, backoff)
    errors: int = 0  # backend errors (lookups and writes)
    slow: int = 0  # lookups over the budget
    write_errors: int = 0  # background writes lost (errors and timeouts)
    slow_writes: int = 0  # of which over write_timeout_ms
    near_cache_hits: int = 0  # blocks answered from the local near-cache
    round_trips: int = 0  # backend round trips (Redis pipelines / scripts)
    evictions: int = 0


class PrefixIndex(Protocol):
    """What routing needs from an index; all methods are safe to call with the backend down."""

    stats: IndexStats

    async def lookup(self, hashes: Sequence[int]) -> Match: ...

    def recent(self, match: Match, hashes: Sequence[int]) -> Match:
        """``match`` with this bridge's own routing writes that it may not show yet (``cache/recent.py``); an index
        whose writes are done when ``record`` returns gives ``match`` back."""
        ...

    async def record(self, replica: int, hashes: Sequence[int]) -> None:
        """Routing time: ``replica`` is about to compute/reuse these blocks (provisional; hits counted)."""
        ...

    async def confirm(self, replica: int, hashes: Sequence[int]) -> None:
        """Engine report: ``replica`` now holds these blocks."""
        ...

    async def drop(self, replica: int, hashes: Sequence[int]) -> None:
        """The turn failed before prefill: remove its still-provisional entries."""
        ...

    async def evict(self, replica: int, hashes: Sequence[int]) -> None:
        """The engine reports it evicted these blocks (KV events): remove them, confirmed or not."""
        ...

    async def forget_replica(self, replica: int) -> None:
        """The replica restarted or left: everything it held is gone."""
        ...

    async def sync(self, replica: int, op: SyncOp, hashes: Sequence[int] = ()) -> bool:
        """An engine's KV event applied now (``confirm``, ``evict`` or ``forget`` the replica): awaited, not a
        background write, never skipped to fail open. False if it could not be written (the caller then
        stops trusting the replica's entries; cache/event_index.py)."""
        ...

    async def pin(self, key: str, replica: int, ttl_s: float) -> int:
        """Pin ``key`` (episode / group id) to ``replica`` unless pinned already; returns the pinned replica."""
        ...

    async def pinned(self, key: str) -> int | None: ...

    async def unpin(self, key: str) -> None: ...

    def set_capacity(self, replica: int, blocks: int) -> None: ...

    def entries(self) -> int:
        """Entries held (for bytes accounting; may be an estimate)."""
        ...

    async def flush(self) -> None:
        """Wait for background writes (tests, shutdown)."""
        ...

    async def close(self) -> None: ...


def horizon(capacity_ratio: float) -> float:
    """Cost eviction: most capacity turnovers an entry may live past its last use (``capacity_ratio``
    = index bound / KV capacity). The engine's LRU keeps a block about one KV turnover =
    1 / ratio index turnovers; an index entry kept longer would only point at evicted KV."""
    return max(1.0, min(REUSE_CAP, 1.0 / capacity_ratio))


def score(
    mode: Eviction, clock: float, reuse: int, holders: int, i: int, n: int, now: float, cap: float = REUSE_CAP
) -> float:
    """Eviction priority of block ``i`` of an ``n``-block chain (higher = kept longer), before the
    parent-above-child floor. ``clock``: the replica's capacity turnovers so far; ``reuse``: requests
    that used the block (all replicas); ``holders``: replicas holding it; ``now``: seconds (LRU);
    ``cap``: ``horizon(capacity_ratio)``."""
    if mode == "lru":
        return quantize(now + (n - i) * 1e-6)
    return quantize(clock + min(reuse / max(1, holders), cap) - 1.0)


def quantize(x: float) -> float:
    """A priority as a whole number of ``1 / SCORE_UNITS`` (the Lua scripts round the same way)."""
    return float(math.floor(x * SCORE_UNITS + 0.5))


def _order(h: int) -> int:
    """Tie order of equal scores: Redis sorts ZSET ties by member bytes (8-byte little-endian hash)."""
    return int.from_bytes(h.to_bytes(8, "little"), "big")


@dataclass(slots=True)
class _Entry:
    hits: int = 0
    until: float = 0.0  # provisional until this time; 0 = confirmed
    prio: float = 0.0
    seq: int = 0


@dataclass(slots=True)
class _Shelf:
    capacity: int
    count: int = 0
    clock: float = 0.0  # cost eviction: insertions / capacity (turnovers)
    heap: list[tuple[float, int, int, int]] = field(default_factory=list)  # (prio, tie order, seq, hash)


class MemoryIndex:
    """In-process index (the embedded default, and the simulator's shared index).

    Sync ``*_now`` methods do the work (the simulator calls them with its own clock); the async
    protocol methods wrap them. One instance can be shared by several routers in one process.
    """

    def __init__(
        self,
        block_size: int,
        capacity: int = 31250,
        eviction: Eviction = "cost",
        provisional_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        ghost_ttl_s: float = 600.0,
        capacity_ratio: float = 1.0,
    ) -> None:
        self.block_size = block_size
        self.default_capacity = capacity
        self.eviction: Eviction = eviction
        self.provisional_ttl_s = provisional_ttl_s
        self.clock = clock
        self.ghost_ttl_s = ghost_ttl_s
        self.horizon = horizon(capacity_ratio)
        self.stats = IndexStats()
        self._holders: dict[int, dict[int, _Entry]] = {}
        self._reuse: dict[int, int] = {}  # cost eviction: requests that used a held block (all replicas)
        # Reuse counts (>= 2) of blocks no replica holds any more: hash -> (count, expiry); at most
        # the sum of the replicas' capacities (oldest first out).
        self._ghosts: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._shelves: dict[int, _Shelf] = {}
        self._pins: dict[str, tuple[int, float]] = {}
        self._seq = itertools.count()

    # -- sync core ----------------------------------------------------------------------

    def _shelf(self, replica: int) -> _Shelf:
        s = self._shelves.get(replica)
        if s is None:
            s = self._shelves[replica] = _Shelf(self.default_capacity)
        return s

    def set_capacity(self, replica: int, blocks: int) -> None:
        self._shelf(replica).capacity = max(1, blocks)
        self._trim(replica)

    def entries(self) -> int:
        return sum(s.count for s in self._shelves.values())

    def lookup_now(self, hashes: Sequence[int]) -> Match:
        self.stats.lookups += 1
        now = self.clock()
        n = len(hashes)
        if not n:
            return Match({}, True, 0)
        first = self._holders.get(hashes[0])
        alive = {r for r, e in first.items() if e.until == 0.0 or e.until > now} if first else set()
        matched: dict[int, int] = {}
        i = 0
        if alive:
            # Only the replicas still matching are checked per block: O(blocks x matching replicas).
            for i in range(1, n):
                holders = self._holders.get(hashes[i])
                if holders is None:
                    break
                gone = [r for r in alive if (e := holders.get(r)) is None or (e.until != 0.0 and e.until <= now)]
                for r in gone:
                    matched[r] = i
                    alive.discard(r)
                if not alive:
                    break
            else:
                i = n
        for r in alive:
            matched[r] = i
        return Match({r: b for r, b in matched.items() if b > 0}, True, min(i + 1, n))

    def record_now(self, replica: int, hashes: Sequence[int]) -> None:
        self._write(replica, hashes, True)

    def confirm_now(self, replica: int, hashes: Sequence[int]) -> None:
        self._write(replica, hashes, False)

    def _write(self, replica: int, hashes: Sequence[int], record: bool) -> None:
        """``record``: routing time (provisional, counts a use); else an engine report (confirmed)."""
        now = self.clock()
        shelf = self._shelf(replica)
        n = len(hashes)
        until = now + self.provisional_ttl_s if record else 0.0
        if self.eviction == "lru":
            for i, h in enumerate(hashes):
                holders = self._holders.setdefault(h, {})
                e = holders.get(replica)
                if e is None:
                    e = holders[replica] = _Entry(hits=1, until=until)
                    shelf.count += 1
                    self._push(shelf, e, h, score("lru", 0.0, 1, 1, i, n, now))
                    continue
                e.until = 0.0 if not record else (until if e.until else 0.0)
                if record:
                    e.hits += 1
                    # Scores only grow; the heap keeps the old (lower) score and _trim re-files it lazily.
                    e.prio = max(e.prio, score("lru", 0.0, e.hits, 1, i, n, now))
            self._trim(replica)
            return
        # Cost: leaf to root, so each parent can be lifted above its child.
        floor = -float("inf")
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            holders = self._holders.setdefault(h, {})
            e = holders.get(replica)
            new = e is None
            if e is None:
                shelf.clock += 1.0 / shelf.capacity
                e = holders[replica] = _Entry(until=until)
                shelf.count += 1
            elif not record:
                e.until = 0.0
            elif e.until:
                e.until = until
            prio = -float("inf") if new else e.prio
            if record or new:  # a use (a routed request, or a block new to this replica)
                e.hits += 1
                reuse = self._use(h, now)
                prio = max(prio, score("cost", shelf.clock, reuse, len(holders), i, n, now, self.horizon))
            prio = max(prio, floor)
            if new:
                self._push(shelf, e, h, prio)
            else:
                e.prio = prio  # only grows: _trim re-files the heap record lazily
            floor = prio + CHAIN_EPS
        self._trim(replica)

    def _use(self, h: int, now: float) -> int:
        """Count one more use of block ``h`` (restoring the count a ghost remembers)."""
        f = self._reuse.get(h)
        if f is None:
            g = self._ghosts.pop(h, None)
            f = g[0] if g is not None and g[1] > now else 0
        f += 1
        self._reuse[h] = f
        return f

    def _unheld(self, h: int) -> None:
        """No replica holds ``h`` any more: keep its reuse count as a ghost for a while (if it was
        reused at all: one-off blocks, e.g. a scan, leave no trace and cannot flush the ghosts)."""
        f = self._reuse.pop(h, None)
        if f is None or f < 2:
            return
        now = self.clock()
        self._ghosts[h] = (f, now + self.ghost_ttl_s)
        bound = sum(s.capacity for s in self._shelves.values())
        ghosts = self._ghosts
        while ghosts and (len(ghosts) > bound or next(iter(ghosts.values()))[1] <= now):
            ghosts.popitem(last=False)

    def drop_now(self, replica: int, hashes: Sequence[int], evicted: bool = False) -> None:
        """Remove the provisional entries among ``hashes`` (every entry when the engine ``evicted`` them)."""
        for h in hashes:
            e = self._holders.get(h, {}).get(replica)
            if e is not None and (e.until or evicted):
                self._remove(replica, h)

    def forget_replica_now(self, replica: int) -> None:
        shelf = self._shelves.pop(replica, None)
        if shelf is None:
            return
        for _, _, _, h in shelf.heap:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(replica, None) is not None and not holders:
                del self._holders[h]
                self._unheld(h)
        self._shelves[replica] = _Shelf(shelf.capacity)

    def _push(self, shelf: _Shelf, e: _Entry, h: int, prio: float) -> None:
        e.prio, e.seq = prio, next(self._seq)
        heapq.heappush(shelf.heap, (prio, _order(h), e.seq, h))

    def _remove(self, replica: int, h: int) -> None:
        holders = self._holders[h]
        del holders[replica]
        if not holders:
            del self._holders[h]
            self._unheld(h)
        self._shelves[replica].count -= 1

    def _trim(self, replica: int) -> None:
        shelf = self._shelves[replica]
        while shelf.count > shelf.capacity:
            prio, order, seq, h = heapq.heappop(shelf.heap)
            e = self._holders.get(h, {}).get(replica)
            if e is None or e.seq != seq:
                continue  # stale heap record (entry dropped and maybe re-added)
            if e.prio > prio:  # touched since it was filed: file it again at its current score
                heapq.heappush(shelf.heap, (e.prio, order, seq, h))
                continue
            self._remove(replica, h)
            self.stats.evictions += 1
        if len(shelf.heap) > 2 * shelf.count + 1024:  # drop records of removed entries
            live = []
            for _, order, seq, h in shelf.heap:
                e = self._holders.get(h, {}).get(replica)
                if e is not None and e.seq == seq:
                    live.append((e.prio, order, seq, h))
            heapq.heapify(live)
            shelf.heap = live

    def pin_now(self, key: str, replica: int, ttl_s: float) -> int:
        now = self.clock()
        cur = self._pins.get(key)
        if cur is not None and cur[1] > now:
            return cur[0]
        self._pins[key] = (replica, now + ttl_s)
        return replica

    def pinned_now(self, key: str) -> int | None:
        cur = self._pins.get(key)
        return cur[0] if cur is not None and cur[1] > self.clock() else None

    # -- async protocol -----------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int]) -> Match:
        return self.lookup_now(hashes)

    def recent(self, match: Match, hashes: Sequence[int]) -> Match:
        return match  # its writes are done when they return

    async def record(self, replica: int, hashes: Sequence[int]) -> None:
        self.record_now(replica, hashes)

    async def confirm(self, replica: int, hashes: Sequence[int]) -> None:
        self.confirm_now(replica, hashes)

    async def drop(self, replica: int, hashes: Sequence[int]) -> None:
        self.drop_now(replica, hashes)

    async def evict(self, replica: int, hashes: Sequence[int]) -> None:
        self.drop_now(replica, hashes, evicted=True)

    async def forget_replica(self, replica: int) -> None:
        self.forget_replica_now(replica)

    async def sync(self, replica: int, op: SyncOp, hashes: Sequence[int] = ()) -> bool:
        if op == "confirm":
            self.confirm_now(replica, hashes)
        elif op == "evict":
            self.drop_now(replica, hashes, evicted=True)
        else:
            self.forget_replica_now(replica)
        return True

    async def pin(self, key: str, replica: int, ttl_s: float) -> int:
        return self.pin_now(key, replica, ttl_s)

    async def pinned(self, key: str) -> int | None:
        return self.pinned_now(key)

    async def unpin(self, key: str) -> None:
        self._pins.pop(key, None)

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None
