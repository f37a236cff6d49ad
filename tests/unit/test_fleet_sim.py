"""The fleet simulator's key claims (issue 6, AC4) on small seeded runs, and its determinism."""

from __future__ import annotations

import pytest

from bench.fleet_sim.engine import EngineSpec, KVCache, Replica, SimRequest
from bench.fleet_sim.sim import Fleet
from bench.fleet_sim.workloads import AgentWorkload, GrpoWorkload


def agent(policy: str, bridges: int = 1, seed: int = 3, **kw: object) -> Fleet:
    return Fleet(policy, replicas=4, bridges=bridges, seed=seed, **kw)  # type: ignore[arg-type]


def test_engine_lru_evicts_tails_before_parents_and_matches_prefixes() -> None:
    kv = KVCache(4)
    kv.touch([1, 2, 3])
    kv.touch([7, 8])
    assert kv.match([1, 2, 3]) == 2 and kv.match([7, 8, 9]) == 2  # 3 (a tail) went first
    assert kv.match([2, 3]) == 0 or kv.match([1]) == 1


def test_engine_prefills_only_uncached_tokens() -> None:
    rep = Replica(0, EngineSpec(block=4, max_batch_tokens=1000))
    first = SimRequest(0, [1, 2, 3], 12, 2, 0.0, [1, 2, 3, 4])
    rep.waiting.append(first)
    t = 0.0
    while rep.has_work():
        dur, _, _ = rep.step(t, t + 1)
        t += dur
    second = SimRequest(1, [1, 2, 3], 13, 1, t, [1, 2, 3])
    rep.waiting.append(second)
    rep.step(t, t + 1)
    # first: 12 prefill + 1 decode (its first token comes with the prefill); second: 1 uncached token
    assert first.cached == 0 and second.cached == 12 and rep.work_tokens == 12 + 1 + 1


def test_same_seed_same_numbers() -> None:
    a = agent("cache_aware").run(AgentWorkload(concurrency=32), until=20, warmup=5)
    b = agent("cache_aware").run(AgentWorkload(concurrency=32), until=20, warmup=5)
    assert (a.turns, a.cached_tokens, a.ttft) == (b.turns, b.cached_tokens, b.ttft)


def test_saturated_agents_cache_aware_doubles_round_robin_and_matches_the_oracle() -> None:
    wl = {"concurrency": 256}
    rr = agent("round_robin").run(AgentWorkload(**wl), until=40, warmup=10)  # type: ignore[arg-type]
    ca = agent("cache_aware").run(AgentWorkload(**wl), until=40, warmup=10)  # type: ignore[arg-type]
    oracle = agent("oracle").run(AgentWorkload(**wl), until=40, warmup=10)  # type: ignore[arg-type]
    assert ca.throughput >= 2.0 * rr.throughput
    assert ca.hit_ratio >= 0.9 * oracle.hit_ratio
    assert ca.ttft_pct(99) < rr.ttft_pct(99)


def test_grpo_group_prompt_is_prefilled_about_once() -> None:
    def prefills(policy: str) -> float:
        w = GrpoWorkload(G=8, groups=24, steps=1)
        agent(policy).run(w, until=600)
        return sum(w.group_prefill) / len(w.group_prefill)

    assert prefills("cache_aware") <= 1.25  # the leader's prefill + each member's partial last block
    assert prefills("round_robin") >= 3.0


@pytest.mark.slow
def test_hit_ratio_is_flat_from_one_to_four_bridges_sharing_the_index() -> None:
    hits = {}
    for b in (1, 4):
        f = agent("cache_aware", bridges=b, seed=11)
        hits[b] = f.run(AgentWorkload(concurrency=128), until=40, warmup=10).hit_ratio
    oracle = agent("oracle", seed=11).run(AgentWorkload(concurrency=128), until=40, warmup=10).hit_ratio
    assert min(hits.values()) >= 0.9 * oracle
    assert abs(hits[1] - hits[4]) <= 0.03


def test_prefix_consistent_hash_collapses_under_skewed_prompts() -> None:
    # The anchors' sanity check: a hash ring pins the popular prefix's traffic on one replica.
    skewed = AgentWorkload(concurrency=192, zipf=1.5, sys_prompts=8)
    ring = agent("prefix_hash", seed=17).run(skewed, until=40, warmup=10)
    ca = agent("cache_aware", seed=17).run(AgentWorkload(concurrency=192, zipf=1.5), until=40, warmup=10)
    assert ring.throughput <= 0.85 * ca.throughput
    assert ring.load_cov > 3 * ca.load_cov


@pytest.mark.slow
def test_cost_aware_index_eviction_recomputes_less_than_lru() -> None:
    # The bench's eviction experiment at full scale (8 replicas, index = 0.1 x KV, Zipf system
    # prompts + periodic scans of one-off documents). The quick scale is too short to separate
    # the policies from seed noise; at full scale every seed tried (1-16) puts cost below LRU.
    from bench.fleet_sim.experiments import FULL, eviction

    ev = eviction(FULL)
    (cost, _, cost_shared), (lru, _, lru_shared) = ev["cost"], ev["lru"]
    assert cost.recomputed < lru.recomputed
    assert cost_shared <= 0.95 * lru_shared
