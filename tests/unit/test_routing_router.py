"""The bridge's Router: configured policies run as configured, TTLs and index sizes come from config
and the placement plan, and every routing decision is exported by reason."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from cache import CacheConfig, Fingerprinter, MemoryIndex
from core.errors import InvalidArgument
from core.salt import CacheSalt
from engines.config import ToyConfig
from engines.toy import ToyEngine
from observability.metrics import BridgeMetrics
from placement.routing import CacheAware, Router, RoutingConfig, StickyFallback, make_policy
from placement.routing.base import RouteRequest

SALT = CacheSalt("toy", 0, tenant="t")


def engines(n: int) -> list[ToyEngine]:
    return [ToyEngine(ToyConfig(), model="toy", replica=f"toy-{i}") for i in range(n)]


def episode(eid: str, replica: int = 0, tokens: int = 40) -> SimpleNamespace:
    return SimpleNamespace(id=eid, replica=replica, token_ids=list(range(tokens)))


async def route_some(router: Router, n: int = 6) -> set[str]:
    for i in range(n):
        ep = episode(f"e{i}", replica=router.replicas.least_loaded())
        await router.route(ep, [], 16, SALT, "")
    return {reason for _, reason, _ in router.decisions()}


@pytest.mark.parametrize(
    ("policy", "reasons"),
    [("round_robin", {"rr"}), ("least_loaded", {"load"}), ("consistent_hash", {"ring"}), ("sticky", {"load"})],
)
async def test_policies_run_as_configured_without_an_index(policy: str, reasons: set[str]) -> None:
    router = Router(engines(3), CacheConfig(enabled=False), RoutingConfig(policy=policy), "")  # type: ignore[arg-type]
    assert router.index is None and router.policy.name == policy
    assert await route_some(router) == reasons
    await router.close()


async def test_cache_aware_without_an_index_says_so_at_start_and_on_every_decision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "primerl.routing"):
        router = Router(engines(3), CacheConfig(enabled=False), RoutingConfig(policy="cache_aware"), "")
    assert isinstance(router.policy, StickyFallback) and router.policy.name == "cache_aware"
    [record] = [r for r in caplog.records if "fallback_sticky" in r.getMessage()]
    assert "cache.enabled = false" in record.getMessage()
    assert await route_some(router) == {"fallback_sticky"}
    with_index = Router(engines(3), CacheConfig(), RoutingConfig(policy="cache_aware"), "")
    assert isinstance(with_index.policy, CacheAware)
    await router.close()
    await with_index.close()


async def test_pin_ttl_comes_from_cache_affinity_ttl() -> None:
    router = Router(engines(2), CacheConfig(affinity_ttl_s=7.5), RoutingConfig(), "")
    assert isinstance(router.policy, CacheAware) and router.policy.pin_ttl_s == 7.5
    await router.close()
    now = [0.0]
    index = MemoryIndex(4, capacity=1000, clock=lambda: now[0])
    policy = make_policy(RoutingConfig(), 3, index, Fingerprinter(block_size=4), pin_ttl_s=5.0)
    d = await policy.choose(RouteRequest("a", "", list(range(8)), str(SALT), 24, first_turn=True))
    key = f"e:{SALT}|a"
    assert await index.pinned(key) == d.replica
    now[0] = 5.1  # the configured lifetime is over
    assert await index.pinned(key) is None


async def test_routing_decisions_are_exported_by_policy_and_reason() -> None:
    router = Router(engines(2), CacheConfig(), RoutingConfig(), "")
    ep = episode("a")
    await router.route(ep, [], 16, SALT, "")
    await router.route(ep, [1, 2, 3], 16, SALT, "")
    metrics = BridgeMetrics()
    view = SimpleNamespace(
        engines=router.engines, info=router.engines[0].info, policy_version=0, store=[], router=router
    )
    metrics.attach(view)  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    assert 'primerl_routing_decisions_total{model="toy",policy="cache_aware",reason="load"} 1.0' in text
    assert 'primerl_routing_decisions_total{model="toy",policy="cache_aware",reason="sticky"} 1.0' in text
    await router.close()


def write_plan(path: Path, kv: list[int], model: str = "toy") -> str:
    reps = [
        {"id": f"r{i}", "model": model, "url": f"http://n:{8000 + i}", "kv_capacity_tokens": k, "block_size": 16,
         "max_num_seqs": 8}
        for i, k in enumerate(kv)
    ]  # fmt: skip
    other = {**reps[0], "id": "x", "model": "other-model"}  # another model's replica: not this bridge's
    path.write_text(json.dumps({"bridge_replicas": [other, *reps]}))
    return str(path)


async def test_the_placement_plan_sizes_the_index_per_replica(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [1600, 3200])
    router = Router(engines(2), CacheConfig(block_size=16), RoutingConfig(plan_file=plan), "")
    assert isinstance(router.index, MemoryIndex)
    assert [router.index._shelf(r).capacity for r in (0, 1)] == [100, 200]  # kv tokens / block size
    unsized = Router(engines(2), CacheConfig(block_size=16), RoutingConfig(), "")
    assert unsized.index._shelf(0).capacity == CacheConfig().default_capacity_blocks  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="lists 2 replicas of model 'toy', but the bridge has 3"):
        Router(engines(3), CacheConfig(block_size=16), RoutingConfig(plan_file=plan), "")
    await router.close()
    await unsized.close()


async def test_a_first_turn_is_not_credited_with_what_its_own_placement_recorded() -> None:
    """StartEpisode places the episode and records its prompt provisionally; its first turn, routed there, finds
    those entries but the engine has computed none of them yet. Another episode with the same prompt is credited."""
    router = Router(engines(2), CacheConfig(block_size=4), RoutingConfig(), "")
    prompt = list(range(32))
    for eid in ("a", "b"):
        replica = await router.place(RouteRequest(eid, "", prompt, str(SALT), 48, first_turn=True))
        await router.route(SimpleNamespace(id=eid, replica=replica, token_ids=prompt), [], 16, SALT, "")
    first, second = router.routes["a"][0], router.routes["b"][0]
    assert first.matched_tokens == 0  # only its own placement's entries were there
    assert second.replica == first.replica and second.matched_tokens == len(prompt)  # "a"'s turn is on its way
    await router.close()
