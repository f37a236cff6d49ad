"""The Redis prefix index against a real private redis-server: sharing, bounds, fail-open, recovery."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cache import CacheConfig, Fingerprinter, MemoryIndex
from cache.loadboard import RedisLoadBoard
from cache.redis_index import RedisIndex
from core.salt import CacheSalt
from placement.routing import CacheAware, RouteRequest
from tests.integration.redis_proc import PrivateRedis

BS = 4
FP = Fingerprinter(block_size=BS)
SALT = str(CacheSalt("m", 1))
# Generous budget: the test machine is shared; the 2 ms budget is measured by bench/cache_index.py.
CFG = CacheConfig(block_size=BS, lookup_budget_ms=200, write_timeout_ms=500, backoff_s=0.2, near_cache_ttl_s=0)


@pytest.fixture(params=["script", "pipeline"])
async def two_indexes(
    redis_server: PrivateRedis, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    cfg = CFG.model_copy(update={"lookup_mode": request.param})
    a, b = RedisIndex(redis_server.url, cfg), RedisIndex(redis_server.url, cfg)
    yield a, b
    await a.close()
    await b.close()


def twin(url: str, now: list[float], capacity: int, **settings: Any) -> tuple[RedisIndex, MemoryIndex]:
    """A Redis index and a memory index with the same settings, on one mocked clock (``now[0]``, seconds)."""
    cfg = CacheConfig(
        block_size=BS, default_capacity_blocks=capacity, lookup_budget_ms=500, write_timeout_ms=5000,
        near_cache_ttl_s=0, **settings,
    )  # fmt: skip
    mem = MemoryIndex(
        BS, capacity=capacity, eviction=cfg.eviction, clock=lambda: now[0], ghost_ttl_s=cfg.ghost_ttl_s,
        capacity_ratio=cfg.capacity_ratio,
    )  # fmt: skip
    return RedisIndex(url, cfg, clock_ms=lambda: now[0] * 1e3), mem


def req(eid: str, toks: list[int], gid: str = "", first: bool = False) -> RouteRequest:
    return RouteRequest(eid, gid, toks, SALT, est_tokens=len(toks) + 8, first_turn=first)


async def test_two_bridges_share_entries_and_pins(two_indexes: tuple[RedisIndex, RedisIndex]) -> None:
    a, b = two_indexes
    hashes = FP.hashes(list(range(40)), SALT)
    await a.record(2, hashes)
    await a.confirm(1, hashes[:4])
    await a.flush()
    m = await b.lookup([*hashes, 123456])
    assert m.ok and m.blocks == {2: 10, 1: 4}
    assert m.looked_up == 11
    assert await a.pin("g:x", 3, 60) == 3
    assert await b.pin("g:x", 1, 60) == 3
    assert await b.pinned("g:x") == 3
    await a.unpin("g:x")
    assert await b.pinned("g:x") is None


async def test_a_lookup_asked_before_this_bridges_write_landed_still_reads_it(
    two_indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    """A burst over one prefix: the second turn's lookup was answered before the first turn's (background) write
    reached Redis; at decision time ``recent`` adds that write, until Redis shows it or an eviction removes it."""
    a, b = two_indexes
    hashes = FP.hashes(list(range(40)), SALT)
    asked = await a.lookup(hashes)
    assert asked.ok and asked.blocks == {}
    await a.record(1, hashes[:6])  # routing's provisional write: a background task
    assert a.recent(asked, hashes).blocks == {1: 6}
    assert b.recent(asked, hashes).blocks == {}  # another bridge reads it from Redis, once it is there
    await a.flush()
    fresh = await a.lookup(hashes)
    assert fresh.blocks == {1: 6} and a.recent(fresh, hashes) == fresh
    assert (await b.lookup(hashes)).blocks == {1: 6}
    await a.evict(1, hashes[3:6])  # (KV events: the engine evicted them)
    assert a.recent(asked, hashes).blocks == {1: 3}
    await a.forget_replica(1)
    assert a.recent(asked, hashes).blocks == {}


async def test_a_burst_of_first_turns_over_one_prompt_goes_where_the_first_of_them_went(
    two_indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    """Sessions over one system prompt, started at once on one bridge: each decision is recorded before the bridge
    awaits anything else (its episode pin goes to Redis after), so the ones decided meanwhile find it and follow
    it, instead of the prompt being prefilled on every replica."""
    policy = CacheAware(2, two_indexes[0], FP)
    system = list(range(64))
    decisions = await asyncio.gather(*(policy.choose(req(f"s{i}", [*system, 1000 + i], first=True)) for i in range(4)))
    assert [d.replica for d in decisions] == [decisions[0].replica] * 4, [(d.replica, d.reason) for d in decisions]
    assert sorted(d.reason for d in decisions) == ["cache", "cache", "cache", "load"]  # the first decided: by load


async def test_entries_written_by_another_process_are_seen(redis_server: PrivateRedis) -> None:
    code = (
        "import asyncio, sys\n"
        "from cache import CacheConfig, Fingerprinter\nfrom core.salt import CacheSalt\n"
        "from cache.redis_index import RedisIndex\n"
        "async def main():\n"
        "    idx = RedisIndex(sys.argv[1], CacheConfig(block_size=4, write_timeout_ms=2000))\n"
        "    await idx.confirm(5, Fingerprinter(block_size=4).hashes(list(range(40)), str(CacheSalt('m', 1))))\n"
        "    await idx.close()\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, redis_server.url)
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    idx = RedisIndex(redis_server.url, CFG)
    try:
        assert (await idx.lookup(FP.hashes(list(range(40)), SALT))).blocks == {5: 10}
    finally:
        await idx.close()


async def test_alternating_bridges_keep_an_episode_and_a_group_on_one_replica(
    two_indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    pa = CacheAware(4, two_indexes[0], FP)
    pb = CacheAware(4, two_indexes[1], FP)
    bridges = [pa, pb]
    history = list(range(30))
    first = await pa.choose(req("ep", history, first=True))
    pa.replicas.begin(first.replica, 100)  # bridge A's load view: that replica is now its busiest
    await pa.observe(first, 0)
    for turn in range(1, 6):
        history += [1000 + turn] * 9
        p = bridges[turn % 2]
        d = await p.choose(req("ep", history))
        assert d.replica == first.replica, (turn, d)
        await p.observe(d, d.matched_tokens)
    # A GRPO group whose members arrive through both bridges shares one replica.
    prompt = list(range(500, 540))
    reps = {(await bridges[i % 2].choose(req(f"m{i}", prompt, gid="G", first=True))).replica for i in range(8)}
    assert len(reps) == 1


async def test_a_bridge_whose_index_fails_keeps_an_episode_on_its_current_replica(redis_server: PrivateRedis) -> None:
    """Bridge A's Redis is unreachable (every lookup, pin and write fails open), bridge B's is healthy: turns
    alternating between them must not ping-pong the episode between A's own pin and the shared pin. A falls
    back to the episode's current replica (its persisted record, ``RouteRequest.current``)."""
    dead = PrivateRedis()
    dead.start()
    dead.close()  # a stopped private Redis: connections are refused
    a_idx, b_idx = RedisIndex(dead.url, CFG), RedisIndex(redis_server.url, CFG)
    pa, pb = CacheAware(4, a_idx, FP), CacheAware(4, b_idx, FP)
    try:
        history = list(range(30))
        first = await pb.choose(req("ep", history, first=True))
        await pb.observe(first, 0)
        pa.replicas.begin(first.replica, 100)  # A's load view: that replica is its busiest (load-only moves away)
        current = first.replica  # what persistence hands the next bridge
        for turn in range(1, 7):
            history += [1000 + turn] * 9
            p = (pa, pb)[turn % 2]
            d = await p.choose(RouteRequest("ep", "", history, SALT, len(history) + 8, current=current))
            await p.observe(d, d.matched_tokens)
            assert d.replica == first.replica, (turn, d)
            current = d.replica
        await a_idx.flush()
        assert a_idx.stats.fail_open >= 3 and a_idx.stats.errors >= 1  # A really ran without its index
    finally:
        await a_idx.close()
        await b_idx.close()


async def test_bounds_and_eviction_match_the_memory_backend(redis_server: PrivateRedis) -> None:
    now = [5000.0]
    cfg = CacheConfig(  # lookups compared, not timed: the default 2 ms budget fails open on a loaded machine
        block_size=BS, default_capacity_blocks=6, lookup_budget_ms=500, write_timeout_ms=2000, near_cache_ttl_s=0
    )
    red = RedisIndex(redis_server.url, cfg, clock_ms=lambda: now[0] * 1e3)
    mem = MemoryIndex(BS, capacity=6, clock=lambda: now[0])
    ops = [(0, [1, 2, 3]), (0, [1, 2, 3]), (0, [7, 8, 9]), (0, [1, 2, 4]), (0, [20, 21, 22]), (0, [1, 2, 3])]
    try:
        for replica, chain in ops:
            await red.record(replica, chain)
            await red.flush()
            mem.record_now(replica, chain)
            now[0] += 1
        held = await red.held(0)
        assert len(held) == 6
        assert held == set(mem._holders)
        for chain in ([1, 2, 3], [7, 8, 9], [20, 21, 22]):
            assert (await red.lookup(chain)).blocks == mem.lookup_now(chain).blocks
    finally:
        await red.close()


@pytest.mark.parametrize("lookup_mode", ["script", "pipeline"])
async def test_cost_eviction_with_shared_reuse_and_ghosts_matches_the_memory_backend(
    redis_server: PrivateRedis, lookup_mode: str
) -> None:
    """Same scores, same evictions, same lookups as the memory index over a mixed run: shared
    prompts on two replicas, private tails, confirms of output blocks, drops, and a prompt that
    is squeezed out and comes back (its reuse count kept in a ghost key with a TTL)."""
    import random

    now = [5000.0]
    red, mem = twin(redis_server.url, now, 10, lookup_mode=lookup_mode, ghost_ttl_s=60, capacity_ratio=0.1)
    cfg = red.cfg
    rng = random.Random(11)
    prompts = [[1000 * p + j for j in range(1, rng.randint(3, 6))] for p in range(1, 4)]
    chains = []
    try:
        for step in range(60):
            chain = [*rng.choice(prompts), *(100_000 + 100 * step + j for j in range(rng.randint(0, 3)))]
            chains.append(chain)
            replica, op = rng.randrange(2), rng.random()
            if op < 0.6:
                await red.record(replica, chain)
                mem.record_now(replica, chain)
            elif op < 0.9:
                chain = [*chain, 200_000 + step]
                await red.confirm(replica, chain)
                mem.confirm_now(replica, chain)
            else:
                await red.drop(replica, chain[-2:])
                mem.drop_now(replica, chain[-2:])
            await red.flush()
            now[0] += 1
            for r in (0, 1):
                held = await red.held(r)
                assert held == {h for h, holders in mem._holders.items() if r in holders}, (step, r)
        assert red.stats.evictions == mem.stats.evictions > 0
        for chain in chains:
            assert (await red.lookup(chain)).blocks == mem.lookup_now(chain).blocks
        for h, f in mem._reuse.items():  # one reuse count per block, over both replicas
            rec = await red.block(h)
            assert rec is not None and rec[0] == f
        # A scan of one-offs squeezes every prompt out of both replicas: reused blocks stay as
        # ghosts (only their count, with a TTL); one-off blocks leave nothing behind.
        for k in range(40):  # 20 turnovers per replica: more than any reuse buys (1 / ratio = 10)
            scan = [300_000 + 100 * k + j for j in range(10)]
            await red.record(k % 2, scan)
            mem.record_now(k % 2, scan)
        await red.flush()
        assert mem._ghosts
        for h, (f, _) in mem._ghosts.items():
            rec = await red.block(h)  # a ghost: no holders, the count and an expiry ghost_ttl_s ahead at most
            assert rec is not None and rec[0] == f and not rec[1] and rec[2] is not None
            assert 0 < rec[2] - now[0] * 1e3 <= 60_000
        gone = [h for h in (100_000 + j for j in range(100)) if h not in mem._ghosts and h not in mem._reuse]
        assert gone and all([await red.block(h) is None for h in gone])
        # A returning prompt gets its count back, and its key loses the TTL again.
        await red.record(0, prompts[0])
        mem.record_now(0, prompts[0])
        await red.flush()
        h0 = prompts[0][0]
        rec = await red.block(h0)
        assert rec is not None and rec[0] == mem._reuse[h0] > 1
        assert rec[2] is None and rec[1] == {0: now[0] * 1e3 + cfg.provisional_ttl_s * 1e3}  # held again, no expiry
        assert (await red.lookup(prompts[0])).blocks == mem.lookup_now(prompts[0]).blocks == {0: len(prompts[0])}
    finally:
        await red.close()


@pytest.mark.parametrize("eviction", ["cost", "lru"])
async def test_bucketed_eviction_order_matches_one_sorted_set(redis_server: PrivateRedis, eviction: str) -> None:
    """With a capacity that spreads a replica's entries over several score buckets (and block records over
    several hash buckets), evictions still pop the replica's lowest entries first, ties by hash bytes,
    exactly as the memory index's single heap does."""
    import random

    now = [7000.0]
    red, mem = twin(redis_server.url, now, 300, index_buckets=64, eviction=eviction, capacity_ratio=0.25)
    rng = random.Random(5)
    shared = [[rng.getrandbits(64) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    try:
        for step in range(50):
            chain = [*rng.choice(shared), *(rng.getrandbits(64) for _ in range(rng.randint(5, 40)))]
            replica = rng.randrange(2)
            if rng.random() < 0.5:
                await red.record(replica, chain)
                mem.record_now(replica, chain)
            else:
                await red.confirm(replica, chain)
                mem.confirm_now(replica, chain)
            await red.flush()
            now[0] += 0.5
            for r in (0, 1):
                assert await red.held(r) == {h for h, hs in mem._holders.items() if r in hs}, (step, r)
        assert red.stats.evictions == mem.stats.evictions > 100
        buckets = await red.redis.zcard(f"{red.cfg.namespace()}:s:0")
        assert buckets > 1  # the replica's entries really are spread over several sorted sets
        for chain in shared:
            assert (await red.lookup(chain)).blocks == mem.lookup_now(chain).blocks
    finally:
        await red.close()


async def test_redis_killed_mid_run_fails_open_then_recovers(redis_server: PrivateRedis) -> None:
    idx = RedisIndex(redis_server.url, CFG)
    p = CacheAware(3, idx, FP)
    toks = list(range(40))
    try:
        d = await p.choose(req("a", toks, first=True))
        p.replicas.unreserve("a")  # its turn ran and ended (begin took the reservation, end the load)
        await p.observe(d, 0)
        await idx.flush()
        assert (await p.choose(req("b", toks, first=True))).reason == "cache"

        redis_server.kill()
        p.replicas.begin(d.replica, 1000)
        for i in range(5):
            t0 = time.perf_counter()
            d2 = await p.choose(req(f"c{i}", toks, first=True))  # never raises
            assert time.perf_counter() - t0 < 0.5
            assert d2.reason == "fail_open" and d2.matched_tokens == 0 and d2.replica != d.replica
            await p.observe(d2, 0)
        await idx.flush()
        assert idx.stats.fail_open >= 5 and idx.stats.errors >= 1

        redis_server.start()  # empty: the index refills from new turns
        await asyncio.sleep(CFG.backoff_s + 0.05)
        d3 = await p.choose(req("d", toks, first=True))
        await p.observe(d3, 0)
        await idx.flush()
        d4 = await p.choose(req("e", [*toks, 1, 2, 3, 4], first=True))
        assert d4.reason == "cache" and d4.replica == d3.replica and d4.matched_tokens == 40
    finally:
        await idx.close()


async def test_lookup_over_budget_fails_open(redis_server: PrivateRedis) -> None:
    idx = RedisIndex(redis_server.url, CacheConfig(block_size=BS, lookup_budget_ms=0.001, near_cache_ttl_s=0))
    try:
        m = await idx.lookup(FP.hashes(list(range(4000)), SALT))
        assert not m.ok and idx.stats.slow == 1 and idx.stats.fail_open == 1
    finally:
        await idx.close()


@pytest.mark.parametrize(("mode", "near_hits"), [("script", 1), ("pipeline", 100)])
async def test_near_cache_answers_repeated_lookups_locally(
    redis_server: PrivateRedis, mode: str, near_hits: int
) -> None:
    cfg = CacheConfig(block_size=BS, lookup_budget_ms=200, near_cache_ttl_s=5, lookup_mode=mode)
    idx = RedisIndex(redis_server.url, cfg)
    hashes = FP.hashes(list(range(400)), SALT)
    try:
        await idx.confirm(0, hashes)
        await idx.flush()
        await idx.lookup(hashes)
        trips = idx.stats.round_trips
        assert (await idx.lookup(hashes)).blocks == {0: 100}
        assert idx.stats.round_trips == trips and idx.stats.near_cache_hits == near_hits
        await idx.record(1, hashes[:10])  # this bridge's own write invalidates what it cached
        await idx.flush()
        assert (await idx.lookup(hashes[:10])).blocks == {0: 10, 1: 10}
    finally:
        await idx.close()


async def test_load_board_shares_in_flight_load_and_fails_open(
    redis_server: PrivateRedis, two_indexes: tuple[RedisIndex, RedisIndex]
) -> None:
    pa, pb = CacheAware(3, two_indexes[0], FP), CacheAware(3, two_indexes[1], FP)
    ba, bb = RedisLoadBoard(two_indexes[0], pa.replicas, ttl_s=5), RedisLoadBoard(two_indexes[1], pb.replicas, ttl_s=5)
    pa.replicas.begin(0, 5000)
    pb.replicas.begin(1, 700)
    await ba.sync_once()
    await bb.sync_once()
    await ba.sync_once()
    assert pa.replicas.remote == [0, 700, 0] and pb.replicas.remote == [5000, 0, 0]
    assert pb.replicas.view() == [5000, 700, 0]
    # Bridge B now sees replica 0 as busy although it routed nothing there itself.
    assert (await pb.choose(req("x", list(range(8)), first=True))).replica == 2
    redis_server.kill()  # Redis gone: each bridge routes on its own load only
    await ba.sync_once()
    assert pa.replicas.remote == [0, 0, 0] and ba.errors == 1


async def test_a_routing_write_over_its_timeout_is_given_up_without_failing_lookups_open(
    redis_server: PrivateRedis,
) -> None:
    """A write that outlives write_timeout_ms is lost and counted, but (unlike a Redis error) puts the index in no
    backoff: the next lookup asks Redis. With a backoff, every lookup for backoff_s (5 s here) would fail open."""
    from redis.asyncio import Redis

    cfg = CFG.model_copy(update={"write_timeout_ms": 50, "backoff_s": 5.0})
    idx, admin = RedisIndex(redis_server.url, cfg), Redis.from_url(redis_server.url)
    held, late = FP.hashes(list(range(100, 108)), SALT), FP.hashes(list(range(200, 208)), SALT)
    try:
        await idx.confirm(0, held)
        await idx.flush()
        await admin.execute_command("CLIENT", "PAUSE", 200, "ALL")  # Redis stalls for 200 ms
        await idx.confirm(1, late)
        await idx.flush()  # gave up after 50 ms
        assert (idx.stats.write_errors, idx.stats.slow_writes, idx.stats.errors) == (1, 1, 0)
        await asyncio.sleep(0.25)  # the pause is over
        match = await idx.lookup(held)
        assert match.ok and match.blocks == {0: 2} and idx.stats.fail_open == 0
    finally:
        await admin.aclose()
        await idx.close()


async def test_kv_event_writes_outwait_a_stalled_redis_and_a_lost_one_drops_the_replica(
    redis_server: PrivateRedis,
) -> None:
    """A routing write gives up after write_timeout_ms (lost, counted); a KV event write must not be lost that way:
    it waits out a stall the routing write gave up on. One that still fails leaves the replica's entries
    untrusted: they are dropped when Redis answers again."""
    from redis.asyncio import Redis

    from cache.event_index import EventIndexer
    from cache.kv_events import Batch, Removed, Stored
    from core.salt import SaltBook

    cfg = CFG.model_copy(update={"write_timeout_ms": 50, "event_write_timeout_ms": 300})
    idx, admin = RedisIndex(redis_server.url, cfg), Redis.from_url(redis_server.url)
    book = SaltBook()
    book.note(SALT)
    ix = EventIndexer(0, idx, FP, book)
    first, second = list(range(100, 108)), list(range(200, 208))
    try:
        await admin.execute_command("CLIENT", "PAUSE", 200, "ALL")  # Redis stalls for 200 ms
        await idx.confirm(1, FP.hashes(second, SALT))  # a routing write: gives up after 50 ms
        await ix.apply(Batch(0, 0.0, (Stored((1, 2), None, first, BS, None, SALT),)))  # waits
        await idx.flush()
        assert idx.stats.write_errors == 1 and ix.counts["write_failures"] == 0
        assert (await idx.lookup(FP.hashes(first, SALT))).blocks == {0: 2}

        await admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")  # longer than both tries of an event write
        await ix.apply(Batch(1, 0.0, (Removed((2,)),)))
        assert ix.counts["write_failures"] == 1 and ix.counts["removed"] == 1  # one event, tried twice
        await asyncio.sleep(0.5)  # the removal may be lost: what the index credits replica 0 is unknown
        await ix.apply(Batch(2, 0.0, ()))  # Redis answers again: the replica's entries go, then events resume
        assert ix.counts["recoveries"] == 1 and ix.blocks == {}
        assert (await idx.lookup(FP.hashes(first, SALT))).blocks == {}
        await ix.apply(Batch(3, 0.0, (Stored((1,), None, first[:BS], BS, None, SALT),)))
        assert (await idx.lookup(FP.hashes(first, SALT))).blocks == {0: 1}
    finally:
        await admin.aclose()
        await idx.close()
