"""Redis down under a fleet (issue 21, acceptance 5), with real processes.

Two fleet bridge processes over two stand-in engine processes on one private Redis, which is then killed:
both bridges keep serving (new episodes, Steps) with the last-known registry, and count it in
``primerl_fail_open_total{component="fleet_registry"}`` on /metrics; ``UpdateWeights`` is refused UNAVAILABLE and
reaches no replica (each still serves its start-up weights). With Redis back (empty: it kept no data), the
bridges list their replicas in the registry again, and the same update goes through on the whole fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.errors import InvalidArgument
from placement.registry import FleetConfig, FleetStore, ReplicaRecord
from rl_client.errors import UnavailableError
from tests.integration.fleet_bridge import FleetBridgeProcess, bridge_pair, fleet_env, standins
from tests.integration.redis_proc import PrivateRedis
from tests.standins.serve import StandinProcess

PROMPT = [1, 4, 30, 31, 32, 2, 5] * 3
SAMPLING = {"max_tokens": 4, "ignore_eos": True, "seed": 3}


@pytest.fixture
def engines() -> Iterator[list[StandinProcess]]:
    with standins(2) as procs:
        yield procs


@pytest.fixture
async def fleet(
    redis_server: PrivateRedis, engines: list[StandinProcess]
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    async with bridge_pair([e.url for e in engines], fleet_env(redis_server.url)) as pair:
        yield pair


async def _fail_opens(bridge: FleetBridgeProcess) -> float:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"http://127.0.0.1:{bridge.metrics_port}/metrics", timeout=10)).text
    for family in text_string_to_metric_families(text):
        if family.name == "primerl_fail_open":
            return sum(s.value for s in family.samples if s.labels.get("component") == "fleet_registry")
    return 0.0


async def _weight_versions(engines: list[StandinProcess]) -> list[str]:
    async with httpx.AsyncClient(trust_env=False) as http:
        return [(await http.get(f"{e.url}/get_weight_version", timeout=5)).json()["weight_version"] for e in engines]


async def _listed(redis_server: PrivateRedis) -> set[str]:
    """The replica URLs the registry lists, once it lists any (within 60 s: the bridges relist at their next
    heartbeat, which a loaded machine delays: a 10 s wait failed once here under load, 2026-11-28)."""
    store = FleetStore.connect(redis_server.url, FleetConfig())
    try:
        for _ in range(1200):
            record = await store.model("toy")
            if record.replicas:
                break
            await asyncio.sleep(0.05)
        return {r.url for r in record.replicas}
    finally:
        await store.close()


async def test_bridges_serve_on_without_redis_and_refuse_version_changes_until_it_is_back(
    fleet: tuple[FleetBridgeProcess, ...],
    engines: list[StandinProcess],
    redis_server: PrivateRedis,
    tmp_path: Path,
) -> None:
    a, b = fleet
    before = await _fail_opens(b)
    redis_server.kill()
    for bridge in (a, b):  # serving on with the last-known registry
        ep = (await bridge.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
        turn = await bridge.client.step(ep, [9])
        assert len(turn.token_ids) == 4 and turn.policy_version == 0
        traj = await bridge.client.end_episode(ep)
        assert traj.token_ids[-4:].tolist() == turn.token_ids.tolist()
    assert await _fail_opens(b) > before  # counted and exported

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with pytest.raises(UnavailableError, match="registry"):
        await a.client.update_weights(str(checkpoint))
    assert await _weight_versions(engines) == ["default", "default"]  # no replica was touched

    for _ in range(2):  # twice: after the first loss every bridge has listed its replicas once already
        redis_server.start()
        # the registry lost its data: the bridges list their replicas again (the fleet's list starts with ours)
        assert await _listed(redis_server) == {e.url for e in engines}
        redis_server.kill()
    redis_server.start()
    assert await a.client.update_weights(str(checkpoint)) == 1
    assert await _weight_versions(engines) == ["1", "1"]
    ep = (await b.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    assert (await b.client.step(ep)).policy_version == 1


async def test_a_bridges_replicas_are_listed_in_one_write(redis_server: PrivateRedis) -> None:
    """Listed one at a time, a second bridge reading between the writes withdrew (and aborted) the replicas not
    yet written; a registry lost just then kept them withdrawn for good (CI, stop 30)."""
    store = FleetStore.connect(redis_server.url, FleetConfig())
    try:
        ours = [ReplicaRecord("http://127.0.0.1:1", "sglang"), ReplicaRecord("http://127.0.0.1:2", "sglang")]
        await store.put_replicas("m", ours)
        record = await store.model("m")
        assert record.replicas == tuple(ours) and record.stamp == 1  # one write, one stamp: never seen half-listed
        with pytest.raises(InvalidArgument, match="must start with http"):
            await store.put_replicas("m", [*ours, ReplicaRecord("127.0.0.1:3", "sglang")])
        assert (await store.model("m")).replicas == tuple(ours)  # a bad URL writes none of the list
    finally:
        await store.close()
