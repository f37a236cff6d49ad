"""A replica that fails is taken out fleet-wide (issue 21, replica health), with real processes.

Two fleet bridges on one private Redis over two stand-in engine processes. The replica serving a Step through
bridge A is SIGKILLed mid-stream: A takes it out of rotation, marks it down in the registry with its backoff,
and bridge B, which never called it since, stops placing episodes on it at its next registry read (its own
health check is far off: ``metrics.health_interval_s`` = 600 s in these tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from rl_client.errors import UnavailableError
from tests.integration.fleet_bridge import FleetBridgeProcess, bridge_pair, fleet_env, standins
from tests.integration.redis_proc import PrivateRedis
from tests.standins.serve import StandinProcess

SHORT = {"max_tokens": 4, "ignore_eos": True, "seed": 5}
LONG = {"max_tokens": 300, "ignore_eos": True, "seed": 5}


def _prompt(i: int) -> list[int]:
    return [1, 4 + i % 50, 30 + i % 7, 31, 32 + i % 11, 2, 5] * 2


@pytest.fixture
def engines() -> Iterator[list[StandinProcess]]:
    with standins(2, "--token-delay-s", "0.01") as procs:
        yield procs


@pytest.fixture
async def fleet(
    redis_server: PrivateRedis, engines: list[StandinProcess]
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    env = fleet_env(redis_server.url, PRIMERL_FLEET__REPLICA_BACKOFF_S="60")
    async with bridge_pair([e.url for e in engines], env) as pair:
        yield pair


async def test_a_replica_that_failed_on_one_bridge_gets_no_new_episodes_on_another(
    fleet: tuple[FleetBridgeProcess, ...], engines: list[StandinProcess], redis_server: PrivateRedis
) -> None:
    a, b = fleet
    started = await a.client.start_episode(_prompt(0), sampling=SHORT)
    victim = engines[int(started.replica[1:])]  # fleet_bridge names the replicas r0, r1
    with pytest.raises(UnavailableError):
        async for _ in a.client.stream_step(started.episode_id, sampling=LONG):
            if victim.proc is not None and victim.proc.poll() is None:
                victim.kill()
    r = aioredis.from_url(redis_server.url)
    try:
        for _ in range(50):  # A's next registry read (fleet.poll_s) marks it down
            if await r.hexists("primerl:fleet:model:toy:down", victim.url):
                break
            await asyncio.sleep(0.1)
        assert await r.hexists("primerl:fleet:model:toy:down", victim.url)
    finally:
        await r.aclose()
    await asyncio.sleep(0.5)  # B's next read
    landed = set()
    for i in range(8):
        ep = await b.client.start_episode(_prompt(10 + i), sampling=SHORT)
        landed.add(ep.replica)
        await b.client.step(ep.episode_id)  # served: never the dead replica
    assert landed == {f"r{1 - int(started.replica[1:])}"}
