"""Two bridge *processes* (``python -m server serve``) sharing one private Redis: the prefix index, the load
board and the episode records are all they share. One episode stepped alternately through both lands on one
engine replica; a GRPO group started through one and stepped through both lands on one replica. Which replica
served a turn is read from each process's Prometheus ``primerl_engine_requests{replica=...}`` counters.
(test_routing_bridges.py checks the same and more with two bridges in one process, where it can look inside.)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.fleet_bridge import FleetBridgeProcess
from tests.integration.redis_proc import PrivateRedis

PROMPT = [1, 4, 30, 31, 32, 2, 5] * 6
SAMPLING = {"max_tokens": 8, "ignore_eos": True, "seed": 1}


class BridgeProcess(FleetBridgeProcess):
    """``primerl serve`` on two toy replicas with the shared Redis index and persistence."""

    def __init__(self, redis_url: str) -> None:
        env = {
            "PRIMERL_ENGINE__TYPE": "toy",
            "PRIMERL_ENGINE__REPLICAS": "2",
            "PRIMERL_REDIS__URL": redis_url,
            "PRIMERL_PERSISTENCE__ENABLED": "true",
            "PRIMERL_CACHE__BLOCK_SIZE": "4",
        }
        super().__init__([], env)

    async def requests_by_replica(self) -> Counter[str]:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)).text
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            if family.name == "primerl_engine_requests":
                for sample in family.samples:
                    if sample.name.endswith("_total") or sample.name == family.name:
                        out[sample.labels["replica"]] += int(sample.value)
        return out


@pytest.fixture
async def two_bridges(redis_server: PrivateRedis) -> AsyncIterator[tuple[BridgeProcess, BridgeProcess]]:
    a, b = BridgeProcess(redis_server.url), BridgeProcess(redis_server.url)
    try:
        await asyncio.gather(a.ready(60), b.ready(60))
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


async def _served(a: BridgeProcess, b: BridgeProcess, before: tuple[Counter[str], Counter[str]]) -> Counter[str]:
    """Generate calls per replica label since ``before``, summed over both processes."""
    now = await asyncio.gather(a.requests_by_replica(), b.requests_by_replica())
    total: Counter[str] = Counter()
    for n, b0 in zip(now, before, strict=True):
        total.update({k: v - b0.get(k, 0) for k, v in n.items() if v - b0.get(k, 0)})
    return total


async def test_two_bridge_processes_keep_an_episode_and_a_group_on_one_replica(
    two_bridges: tuple[BridgeProcess, BridgeProcess],
) -> None:
    a, b = two_bridges
    for _ in range(3):  # several episodes, so least-loaded alone would alternate replicas
        before = await asyncio.gather(a.requests_by_replica(), b.requests_by_replica())
        ep = (await a.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
        for i in range(6):
            await (a if i % 2 else b).client.step(ep, [9] if i else None)
        await a.client.end_episode(ep)
        served = await _served(a, b, (before[0], before[1]))
        assert sum(served.values()) == 6 and len(served) == 1, served  # six turns, one replica, both processes

    before = await asyncio.gather(a.requests_by_replica(), b.requests_by_replica())
    started = await b.client.start_episode(PROMPT, group_size=8, sampling=SAMPLING)
    for i, ep in enumerate(started.episode_ids):
        await (a if i % 2 else b).client.step(ep)
    served = await _served(a, b, (before[0], before[1]))
    assert sum(served.values()) == 8 and len(served) == 1, served
