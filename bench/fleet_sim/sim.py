"""Discrete-event fleet simulation: N engine replicas, 1..8 bridges sharing one prefix index.

Each bridge runs the *real* routing code (placement/routing/) over the *real* index code
(cache/index.py ``MemoryIndex``, standing in for Redis): the bridges' views add a simulated
round trip per index operation and a near-cache of lookup answers (stale for up to its TTL,
invalidated by the bridge's own writes, as in cache/redis_index.py). Bridges see only their
own in-flight load plus the others' as a load board last published it (every
``board_period_s``; cache/loadboard.py), as real bridge processes do. Turns pick a bridge at random (a load
balancer without affinity: the hard case). The oracle routes with the same cost rule but
reads the replicas' true KV state and the global load (an upper bound, zero lag).

Deterministic for a seed: one ``random.Random`` drives the workload; ties in the event heap
are broken by insertion order.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.fleet_sim.engine import EngineSpec, Replica, SimRequest
from bench.fleet_sim.loadboard import MemoryLoadBoard
from cache.fingerprint import Fingerprinter
from cache.index import BYTES_PER_ENTRY, IndexStats, Match, MemoryIndex, SyncOp
from placement.routing import CacheAware, Decision, Policy, RouteRequest, RoutingConfig, make_policy

POLICIES = (
    "round_robin",
    "least_loaded",
    "sticky",
    "consistent_hash",
    "prefix_hash",
    "cache_aware",
    "oracle",
)


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine that never suspends (the memory index does no I/O) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a simulated index call suspended")


class Workload(Protocol):
    name: str

    def start(self, fleet: Fleet) -> None: ...


class SharedView:
    """One bridge's handle on the shared index: round trips counted, near-cache of lookup answers."""

    def __init__(self, index: MemoryIndex, fleet: Fleet, near_ttl_s: float) -> None:
        self.index = index
        self.fleet = fleet
        self.near_ttl_s = near_ttl_s
        self.stats = IndexStats()
        self._near: dict[int, tuple[float, Match]] = {}

    def _trip(self) -> None:
        self.stats.round_trips += 1

    def recent(self, match: Match, hashes: Sequence[int]) -> Match:
        return match  # writes land in the shared MemoryIndex at once

    async def lookup(self, hashes: Sequence[int]) -> Match:
        self.stats.lookups += 1
        if not hashes:
            return Match()
        key = hashes[-1] ^ len(hashes)
        hit = self._near.get(key)
        if hit is not None and hit[0] >= self.fleet.now:
            self.stats.near_cache_hits += 1
            return hit[1]
        self._trip()
        m = self.index.lookup_now(hashes)
        if self.near_ttl_s > 0:
            self._near[key] = (self.fleet.now + self.near_ttl_s, m)
            if len(self._near) > 65536:
                self._near.clear()
        return m

    async def record(self, replica: int, hashes: Sequence[int]) -> None:
        if hashes:
            self._near.pop(hashes[-1] ^ len(hashes), None)
        self._trip()
        self.index.record_now(replica, hashes)

    async def confirm(self, replica: int, hashes: Sequence[int]) -> None:
        if hashes:
            self._near.pop(hashes[-1] ^ len(hashes), None)
        self._trip()
        self.index.confirm_now(replica, hashes)

    async def drop(self, replica: int, hashes: Sequence[int]) -> None:
        self._trip()
        self.index.drop_now(replica, hashes)

    async def evict(self, replica: int, hashes: Sequence[int]) -> None:
        self._near.clear()
        self._trip()
        self.index.drop_now(replica, hashes, evicted=True)

    async def forget_replica(self, replica: int) -> None:
        self._near.clear()
        self._trip()
        self.index.forget_replica_now(replica)

    async def sync(self, replica: int, op: SyncOp, hashes: Sequence[int] = ()) -> bool:
        self._near.clear()
        self._trip()
        return await self.index.sync(replica, op, hashes)

    async def pin(self, key: str, replica: int, ttl_s: float) -> int:
        self._trip()
        return self.index.pin_now(key, replica, ttl_s)

    async def pinned(self, key: str) -> int | None:
        self._trip()
        return self.index.pinned_now(key)

    async def unpin(self, key: str) -> None:
        self._trip()
        self.index._pins.pop(key, None)

    def set_capacity(self, replica: int, blocks: int) -> None:
        self.index.set_capacity(replica, blocks)

    def entries(self) -> int:
        return self.index.entries()

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


class OracleIndex(MemoryIndex):
    """Exact, zero-lag knowledge of every replica's KV cache (pins as in the memory index)."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet.block, clock=lambda: fleet.now)
        self.fleet = fleet

    def lookup_now(self, hashes: Sequence[int]) -> Match:
        blocks = list(hashes)
        out = {r.idx: n for r in self.fleet.replicas if r.up and (n := r.kv.match(blocks))}
        return Match(out, True, len(blocks))

    def record_now(self, replica: int, hashes: Sequence[int]) -> None:
        return None

    def confirm_now(self, replica: int, hashes: Sequence[int]) -> None:
        return None


@dataclass
class Result:
    policy: str
    workload: str
    bridges: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    out_tokens: int = 0
    turns: int = 0
    window_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    load_cov: float = 0.0
    index_entries: int = 0
    index_ops_per_turn: float = 0.0
    fail_open: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def recomputed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the measurement window."""
        return self.out_tokens / max(1e-9, self.window_s)

    def ttft_pct(self, q: float) -> float:
        if not self.ttft:
            return float("nan")
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


class Fleet:
    def __init__(
        self,
        policy: str,
        replicas: int = 8,
        bridges: int = 1,
        seed: int = 0,
        spec: EngineSpec | None = None,
        rtt_s: float = 0.0005,
        near_ttl_s: float = 0.5,
        eviction: str = "cost",
        index_capacity_ratio: float = 1.0,
        routing: RoutingConfig | None = None,
        board_period_s: float = 0.02,
    ) -> None:
        self.spec = spec or EngineSpec()
        self.block = self.spec.block
        self.rng = random.Random(seed)
        self.now = 0.0
        self.policy_name = policy
        self.replicas = [Replica(i, self.spec) for i in range(replicas)]
        self.rtt_s = rtt_s
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._stop = float("inf")
        self.index_capacity = max(1, int(self.spec.kv_tokens // self.block * index_capacity_ratio))
        self.index = MemoryIndex(
            self.block,
            capacity=self.index_capacity,
            eviction=eviction,  # type: ignore[arg-type]
            provisional_ttl_s=30.0,
            clock=lambda: self.now,
            capacity_ratio=index_capacity_ratio,
        )
        cfg = routing or RoutingConfig()
        fp = Fingerprinter(block_size=self.block)
        self.views: list[SharedView] = []
        self.policies: list[Policy] = []
        if policy == "oracle":
            shared = CacheAware(replicas, OracleIndex(self), fp, cfg)
            self.policies = [shared] * bridges
        else:
            for _ in range(bridges):
                view = SharedView(self.index, self, near_ttl_s)
                self.views.append(view)
                if policy == "prefix_hash":
                    c = cfg.model_copy(update={"policy": "consistent_hash", "ring_key": "prefix"})
                elif policy == "ch_bounded":
                    c = cfg.model_copy(update={"policy": "consistent_hash", "ring_load_bound": 1.25})
                else:
                    c = cfg.model_copy(update={"policy": policy})
                self.policies.append(make_policy(c, replicas, view, fp))
        # Bridges share their in-flight load through a load board refreshed every board_period_s.
        self.board = (
            MemoryLoadBoard([p.replicas for p in dict.fromkeys(self.policies)])
            if bridges > 1 and board_period_s > 0
            else None
        )
        self.board_period_s = board_period_s
        # measurement
        self.warmup = 0.0
        self.res = Result(policy, "", bridges)
        self._load_samples: list[list[int]] = []
        self._per_replica: dict[int, list[int]] = {i: [0, 0] for i in range(64)}

    # -- scheduling -----------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def rid(self) -> int:
        return next(self._rid)

    def stop_at(self, t: float) -> None:
        self._stop = min(self._stop, t)

    def run(self, workload: Workload, until: float, warmup: float = 0.0) -> Result:
        self.warmup = warmup
        self.res.workload = workload.name
        workload.start(self)
        self.at(1.0, Fleet._sample)
        if self.board is not None:
            self.at(0.0, Fleet._sync_board)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            if t > until or t > self._stop:
                break
            self.now = t
            fn(self, *args)
        end = min(until, self._stop, self.now)
        self.res.window_s = max(1e-9, end - warmup)
        means = [statistics.fmean(col) for col in zip(*self._load_samples, strict=False)] if self._load_samples else []
        if len(means) > 1 and statistics.fmean(means) > 0:
            self.res.load_cov = statistics.pstdev(means) / statistics.fmean(means)
            hot = max(range(len(means)), key=means.__getitem__)
            p, c = self._per_replica[hot]
            self.res.extra["hot_replica_hit_ratio"] = c / max(1, p)
            self.res.extra["hot_replica_share"] = p / max(1, self.res.prompt_tokens)
        self.res.index_entries = self.index.entries()
        trips = sum(v.stats.round_trips for v in self.views)
        self.res.index_ops_per_turn = trips / max(1, self.res.turns)
        self.res.extra["index_bytes"] = self.res.index_entries * BYTES_PER_ENTRY
        return self.res

    def _sync_board(self) -> None:
        assert self.board is not None
        self.board.sync_once()
        self.at(self.now + self.board_period_s, Fleet._sync_board)

    def _sample(self) -> None:
        if self.now >= self.warmup:
            self._load_samples.append([r.inflight_tokens() for r in self.replicas])
        self.at(self.now + 1.0, Fleet._sample)

    # -- bridge side ----------------------------------------------------------------------

    def submit(self, req: SimRequest, episode_id: str, group_id: str, first: bool, max_tokens: int) -> None:
        b = self.rng.randrange(len(self.policies))
        policy = self.policies[b]
        rr = RouteRequest(
            episode_id, group_id, (), "", est_tokens=0, hashes=req.blocks, prompt_tokens=req.prompt_tokens,
            first_turn=first,
        )  # fmt: skip
        view = self.views[b] if self.views else None
        trips0 = view.stats.round_trips if view else 0
        d: Decision = run_sync(policy.choose(rr))
        load = req.prompt_tokens - d.matched_tokens + max_tokens
        policy.replicas.begin(d.replica, load)
        req.route = (b, d, load)
        delay = ((view.stats.round_trips - trips0) if view else 0) * self.rtt_s
        self.at(self.now + delay, Fleet._enqueue, d.replica, req)

    def _enqueue(self, replica: int, req: SimRequest) -> None:
        rep = self.replicas[replica]
        rep.waiting.append(req)
        if not rep.busy:
            rep.busy = True
            self._step(rep)

    def _step(self, rep: Replica) -> None:
        if not rep.has_work() or not rep.up:
            rep.busy = False
            return
        nxt = self._heap[0][0] if self._heap else self.now + 1.0
        dur, _first, finished = rep.step(self.now, nxt)
        self.at(self.now + dur, Fleet._step_done, rep, finished)

    def _step_done(self, rep: Replica, finished: list[SimRequest]) -> None:
        for req in finished:
            self._finish(req)
        self._step(rep)

    def _finish(self, req: SimRequest) -> None:
        b, d, load = req.route
        policy = self.policies[b]
        policy.replicas.end(d.replica, load)
        held = req.held_after
        run_sync(policy.observe(d, req.cached, True, held))
        if req.arrival >= self.warmup:
            self._per_replica[d.replica][0] += req.prompt_tokens
            self._per_replica[d.replica][1] += req.cached
            r = self.res
            r.turns += 1
            r.prompt_tokens += req.prompt_tokens
            r.cached_tokens += req.cached
            r.out_tokens += req.out_tokens
            r.ttft.append(req.first_token - req.arrival)
        req.owner[0](self, req)

    def release(self, episode_id: str, group_id: str) -> None:
        for p in dict.fromkeys(self.policies):
            run_sync(p.release(episode_id, group_id))

    # -- faults ---------------------------------------------------------------------------

    def restart(self, replica: int) -> None:
        rep = self.replicas[replica]
        lost = rep.restart()
        for p in dict.fromkeys(self.policies):
            run_sync(p.replica_reset(replica))
        for req in lost:
            b, d, load = req.route
            self.policies[b].replicas.end(d.replica, load)
            req.cached = req.generated = 0
            req.first_token = -1.0
            run_sync(self.policies[b].observe(d, 0, False))
            self.submit(req, f"re{req.rid}", "", True, 512)

    def scale_out(self, n: int) -> None:
        while len(self.replicas) < n:
            self.replicas.append(Replica(len(self.replicas), self.spec))
        for p in dict.fromkeys(self.policies):
            p.replicas.resize(n)
