"""Routing policies: baselines, consistent hashing, and the cache-aware policy's decisions."""

from __future__ import annotations

import asyncio
from collections import Counter

from cache import Fingerprinter, MemoryIndex
from core.salt import CacheSalt
from placement.routing import (
    CacheAware,
    ConsistentHash,
    LeastLoaded,
    ReplicaSet,
    RouteRequest,
    RoutingConfig,
    StickyEpisode,
    make_policy,
)

BS = 4
FP = Fingerprinter(block_size=BS)
SALT = str(CacheSalt("m", 1))


def cache_aware(n: int = 4, **cfg: object) -> CacheAware:
    return CacheAware(n, MemoryIndex(BS, capacity=10_000), FP, RoutingConfig(**cfg))


def req(eid: str, toks: list[int], gid: str = "", first: bool = False, salt: str = SALT) -> RouteRequest:
    return RouteRequest(eid, gid, toks, salt, est_tokens=len(toks) + 16, first_turn=first)


async def test_round_robin_and_least_loaded() -> None:
    rr = make_policy(RoutingConfig(policy="round_robin"), 3)
    assert [(await rr.choose(req("e", []))).replica for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoaded(3)
    ll.replicas.begin(0, 100)
    ll.replicas.begin(2, 50)
    assert (await ll.choose(req("e", []))).replica == 1
    ll.replicas.end(0, 100)
    ll.replicas.begin(1, 70)
    assert (await ll.choose(req("e", []))).replica == 0


async def test_sticky_pins_episodes_and_groups() -> None:
    p = StickyEpisode(3)
    first = (await p.choose(req("a", [], gid="g"))).replica
    p.replicas.begin(first, 1000)
    assert (await p.choose(req("b", [], gid="g"))).replica == first  # group member joins it
    assert (await p.choose(req("a", []))).replica == first  # later turn stays
    assert (await p.choose(req("c", []))).replica != first  # new episode: least loaded


async def test_consistent_hash_is_stable_and_bounded_load_spills() -> None:
    ring = ConsistentHash(4, vnodes=32)
    owners = Counter([(await ring.choose(req(f"e{i}", []))).replica for i in range(400)])
    assert len(owners) == 4 and min(owners.values()) > 40
    r = (await ring.choose(req("hot", []))).replica
    assert [(await ring.choose(req("hot", []))).replica for _ in range(5)] == [r] * 5
    bounded = ConsistentHash(4, vnodes=32, load_bound=1.25)
    bounded.replicas.begin(r, 10_000)
    assert (await bounded.choose(req("hot", []))).replica != r


async def test_cache_aware_follows_the_longest_cached_prefix() -> None:
    p = cache_aware()
    history = list(range(64))
    d1 = await p.choose(req("a", history, first=True))
    assert d1.reason == "load" and d1.matched_tokens == 0
    p.replicas.unreserve("a")  # its turn ran and ended (begin took the reservation, end the load)
    await p.observe(d1, cached_tokens=0)
    # Another episode with the same long prefix is credited on that replica.
    d2 = await p.choose(req("b", [*history, 1, 2, 3, 4], first=True))
    assert d2.replica == d1.replica and d2.reason == "cache" and d2.matched_tokens == 64


async def test_a_burst_of_first_turns_sharing_a_header_spreads_over_the_replicas() -> None:
    """Eight episodes start at once (no turn has begun yet), sharing a 64-token header: each decision counts on
    its replica at once (``ReplicaSet.reserve``), so the next one weighs the header against that work instead of
    every episode following the header to one replica, where their sessions would evict each other's KV."""
    p = cache_aware(n=2)
    header = list(range(1000, 1064))
    bursts = [req(f"s{i}", [*header, *range(i * 100, i * 100 + 64)], first=True) for i in range(8)]
    decisions = await asyncio.gather(*(p.choose(r) for r in bursts))
    assert Counter(d.replica for d in decisions) == {0: 4, 1: 4}, decisions
    reserved = [r.est_tokens - d.matched_tokens for r, d in zip(bursts, decisions, strict=True)]
    assert sum(p.replicas.load) == sum(reserved)
    # Each turn's engine call begins: its load replaces its reservation; what never begins lapses.
    p.replicas.begin(decisions[0].replica, 50, "s0")
    p.replicas.unreserve("s1")
    assert sum(p.replicas.load) == sum(reserved[2:]) + 50


async def test_reservations_lapse() -> None:
    now = [0.0]
    p = CacheAware(ReplicaSet(2, clock=lambda: now[0]), MemoryIndex(BS, capacity=100), FP)
    d = await p.choose(req("gone", list(range(16)), first=True))
    assert p.replicas.load[d.replica] == 32
    now[0] = ReplicaSet.RESERVE_TTL_S + 1  # its client never stepped
    await p.choose(req("next", list(range(100, 104)), first=True))
    assert p.replicas.load[d.replica] in (0, 20)  # "gone" lapsed; "next" (20 tokens) may sit on the same replica
    assert sum(p.replicas.load) == 20


async def test_cache_aware_weighs_prefix_against_load_and_sheds_hot_replicas() -> None:
    prefix = list(range(40))
    for threshold, reason in ((1.0, "load"), (0.5, "cache")):
        p = cache_aware(balance_abs_tokens=100, balance_rel=1.5, cache_threshold=threshold)
        d1 = await p.choose(req("a", prefix, first=True))
        p.replicas.begin(d1.replica, 60, "a")  # its turn runs: loaded (60 tokens) but not hot
        d2 = await p.choose(req("b", [*prefix, 7, 7, 7, 7], first=True))
        # Weighed (cache_threshold 1): the 40 cached tokens are worth less than 60 tokens of extra queue. Past the
        # threshold (40 of 44 cached > 0.5, SGLang's rule) the cached replica wins while it is not hot.
        assert (d2.replica == d1.replica) == (reason == "cache") and d2.reason == reason, (threshold, d2)
    # Now hot (load - min > 100 and > 1.5 x min): new episodes avoid it, however much of their prompt it holds ...
    p.replicas.begin(d1.replica, 1000)
    d3 = await p.choose(req("c", prefix, first=True))
    assert d3.replica != d1.replica
    # ... and its own episode is moved off only because moving is cheaper than queueing there.
    d4 = await p.choose(req("a", [*prefix, 9, 9, 9, 9]))
    assert d4.reason == "shed" and d4.replica != d1.replica


async def test_a_hot_replica_sheds_an_episode_whose_history_only_it_holds() -> None:
    """The cache threshold applies among replicas that are not hot: an agent whose whole history sits on its
    pinned replica still moves off when that replica is hot and moving is cheaper than queueing there."""
    p = cache_aware(n=2, balance_abs_tokens=100, balance_rel=1.5)
    history = list(range(40))
    d1 = await p.choose(req("a", history, first=True))
    await p.observe(d1, 0)
    p.replicas.begin(d1.replica, 1000, "a")  # its replica is now hot; nothing of the history is on the other
    d2 = await p.choose(req("a", [*history, 9, 9, 9, 9]))
    assert d2.replica != d1.replica and d2.reason == "shed", d2


async def test_a_shared_system_prompt_stays_on_one_replica_while_a_short_header_spreads() -> None:
    """Requests arriving together over one long system prompt (224 of 248 tokens shared) all go where it is
    cached, while that replica is not hot, instead of prefilling it on every replica; agents sharing a header
    of half their prompt spread (the burst test above)."""
    p = cache_aware(n=2)
    system = list(range(2000, 2224))
    decisions = [await p.choose(req(f"u{i}", [*system, *range(i * 100, i * 100 + 24)], first=True)) for i in range(6)]
    assert {d.replica for d in decisions} == {decisions[0].replica}, decisions
    assert [d.reason for d in decisions[1:]] == ["cache"] * 5


async def test_sticky_turns_stay_while_the_replica_is_not_hot() -> None:
    p = cache_aware()
    d1 = await p.choose(req("a", list(range(8)), first=True))
    p.replicas.begin((d1.replica + 1) % 4, 5)  # others' load changes do not move it
    p.replicas.begin(d1.replica, 50)
    d2 = await p.choose(req("a", list(range(12))))
    assert d2.replica == d1.replica and d2.reason == "sticky"


async def test_grpo_group_lands_on_one_replica() -> None:
    p = cache_aware()
    prompt = list(range(32))
    reps = set()
    for i in range(16):
        d = await p.choose(req(f"m{i}", prompt, gid="grp", first=True))
        p.replicas.begin(d.replica, 500)  # members pile up: still one replica (one prompt prefill)
        reps.add(d.replica)
    assert len(reps) == 1
    await p.release(group_id="grp")
    d = await p.choose(req("other", list(range(100, 132)), gid="grp2", first=True))
    assert d.replica not in reps  # the next group goes elsewhere: that replica is loaded


async def test_policy_version_salt_voids_old_kv_and_pins() -> None:
    p = cache_aware()
    toks = list(range(64))
    d1 = await p.choose(req("a", toks, first=True))
    await p.observe(d1, 0)
    p.replicas.begin(d1.replica, 10)  # the old replica is now slightly busier
    new_salt = str(CacheSalt("m", 2))  # UpdateWeights
    d2 = await p.choose(req("a", [*toks, 1, 2, 3, 4], salt=new_salt))
    assert d2.matched_tokens == 0 and d2.reason == "load" and d2.replica != d1.replica
    d3 = await p.choose(req("b", toks, salt=new_salt, first=True))
    assert d3.matched_tokens == 0 or d3.replica == d2.replica  # only KV computed under version 2 counts


async def test_fail_open_routes_by_load_and_keeps_local_pins() -> None:
    class DownIndex(MemoryIndex):
        def lookup_now(self, hashes):  # type: ignore[no-untyped-def]
            self.stats.fail_open += 1
            from cache.index import Match

            return Match(ok=False)

    idx = DownIndex(BS)
    p = CacheAware(3, idx, FP)
    p.replicas.begin(0, 100)
    p.replicas.begin(1, 100)
    d = await p.choose(req("a", list(range(32)), first=True))
    assert d.replica == 2 and d.reason == "fail_open" and d.matched_tokens == 0
    assert (await p.choose(req("a", list(range(36))))).reason == "sticky"
    assert idx.stats.fail_open == 2


async def test_engine_reports_confirm_or_drop_and_count_stale_routes() -> None:
    idx = MemoryIndex(BS, provisional_ttl_s=1e9)
    p = CacheAware(2, idx, FP)
    toks = list(range(16))
    d = await p.choose(req("a", toks, first=True))
    await p.observe(d, cached_tokens=0, ok=False)  # failed before prefill
    assert idx.lookup_now(d.hashes).blocks == {}
    for eid in "ab":
        p.replicas.unreserve(eid)  # turns that ran and ended: no load left
    d = await p.choose(req("b", toks, first=True))
    await p.observe(d, 0)
    p.replicas.unreserve("b")
    d2 = await p.choose(req("c", toks, first=True))
    assert d2.matched_tokens == 16
    await p.observe(d2, cached_tokens=0)  # the engine had evicted it
    assert p.stats.stale_routes == 1 and p.stats.predicted_tokens == 16 and p.stats.reported_cached_tokens == 0
    # Credited against reported, capped as engines cap a hit (a 16-token prompt: at most 12 cached at block 4).
    assert p.stats.predictions == {"exact": 1, "over": 1}  # b: 0 credited, 0 cached; c: 12 credited, 0 cached
    p.replicas.unreserve("c")
    d3 = await p.choose(req("d", toks, first=True))
    await p.observe(d3, cached_tokens=12)
    p.replicas.unreserve("d")
    d4 = await p.choose(req("e", [*toks, 99, 98, 97, 96], first=True))
    await p.observe(d4, cached_tokens=d4.matched_tokens + BS)  # the engine held a block the index did not know
    assert p.stats.predictions == {"exact": 2, "over": 1, "under": 1}


async def test_an_event_fed_replica_confirms_nothing_from_reports() -> None:
    clock = [0.0]
    idx = MemoryIndex(BS, provisional_ttl_s=30, clock=lambda: clock[0])
    p = CacheAware(2, idx, FP)
    d = await p.choose(req("a", list(range(16)), first=True))
    idx.confirm_now(d.replica, d.hashes[:2])  # the engine's events: the first two blocks stored (so far)
    await p.observe(d, 16, learned=False)
    assert idx.lookup_now(d.hashes).blocks == {d.replica: 4}  # the rest still provisional: events may follow
    clock[0] = 31.0
    assert idx.lookup_now(d.hashes).blocks == {d.replica: 2}  # no event confirmed them: expired, not confirmed


async def test_unhealthy_replicas_get_no_turns_and_pins_move_off_them() -> None:
    p = cache_aware(3)
    toks = list(range(40))
    d = await p.choose(req("a", toks, gid="g", first=True))
    assert p.replicas.mark(d.replica, False) and not p.replicas.mark(d.replica, False)
    d2 = await p.choose(req("a", [*toks, 1, 2, 3, 4], gid="g"))
    assert d2.replica != d.replica
    assert (await p.choose(req("b", toks, gid="g", first=True))).replica == d2.replica  # the group followed
    for policy in (make_policy(RoutingConfig(policy=name), 3) for name in ("round_robin", "least_loaded", "sticky")):
        policy.replicas.mark(1, False)
        assert {(await policy.choose(req(f"e{i}", []))).replica for i in range(6)} <= {0, 2}
    ring = ConsistentHash(3)
    r = (await ring.choose(req("k", []))).replica
    ring.replicas.mark(r, False)
    assert (await ring.choose(req("k", []))).replica != r
