"""One policy version per model across a fleet (issue 21, acceptance 1), with real processes.

Two bridge processes (``tests/integration/fleet_bridge.py``) on one private Redis share two engine replicas
served as their own processes (the SGLang stand-in over the toy model). ``UpdateWeights`` through bridge A,
then a Step through bridge B: every token of B's new turn carries the new version, B salts the prefix cache
with it (its routing index in Redis holds the turn's blocks under the new version's salt only), each replica
reloaded exactly once (its greedy log-probabilities equal those of a reference server reloaded once: the toy's
reload perturbs its tables, so a second reload would show), and ``admission.max_staleness`` is measured
against the fleet's version on a bridge that never ran an update itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from cache.config import CacheConfig
from cache.fingerprint import Fingerprinter
from cache.redis_index import RedisIndex
from core.salt import salt_text
from rl_client.errors import BridgeError
from tests.integration.fleet_bridge import FleetBridgeProcess, bridge_pair, fleet_env, standins
from tests.integration.redis_proc import PrivateRedis
from tests.standins.serve import StandinProcess

PROMPT = [1, 4, 30, 31, 32, 2, 5] * 3
SAMPLING = {"max_tokens": 6, "ignore_eos": True, "seed": 1}
INDEX = CacheConfig(block_size=4)  # the routing index's layout (cache block size 4, fleet_env)


@pytest.fixture
def replicas() -> Iterator[list[StandinProcess]]:
    """Two replicas of the fleet and a reference server (never behind a bridge)."""
    with standins(3) as procs:
        yield procs


@pytest.fixture
async def fleet(
    redis_server: PrivateRedis, replicas: list[StandinProcess]
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    env = fleet_env(redis_server.url, PRIMERL_ADMISSION__MAX_STALENESS="1")
    async with bridge_pair([replicas[0].url, replicas[1].url], env) as pair:
        yield pair


async def _greedy_logprobs(url: str) -> list[Any]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_logprob": True,
    }
    async with httpx.AsyncClient(trust_env=False) as http:
        out = (await http.post(f"{url}/generate", json=body, timeout=10)).json()
    return list(out["meta_info"]["output_token_logprobs"])


async def _indexed(r: aioredis.Redis, token_ids: list[int], salt: str) -> bool:
    """Whether the routing index holds the last full block of ``token_ids`` under ``salt`` (writes are async)."""
    last = Fingerprinter(block_size=4).hashes(token_ids, salt)[-1]
    for _ in range(50):
        if await r.hexists(*RedisIndex.block_key_of(INDEX, last)):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_update_through_a_is_adopted_by_b_before_its_next_token(
    fleet: tuple[FleetBridgeProcess, ...],
    replicas: list[StandinProcess],
    redis_server: PrivateRedis,
    tmp_path: Path,
) -> None:
    a, b = fleet
    ep = (await b.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    stale = (await b.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    await b.client.step(ep)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()

    assert await a.client.update_weights(str(checkpoint)) == 1
    await b.client.step(ep, [9, 10])
    traj = await b.client.end_episode(ep)
    first, second = traj.turns
    assert set(traj.policy_versions[: first.end].tolist()) == {0}
    assert set(traj.policy_versions[second.observation_start :].tolist()) == {1}  # B's new tokens: version 1
    assert second.policy_version == 1

    r = aioredis.from_url(redis_server.url)
    try:
        assert await r.hget("primerl:fleet:model:toy", "version") == b"1"
        history = traj.token_ids.tolist()
        assert await _indexed(r, history, salt_text("toy", 1))  # B's salt carries version 1 ...
        assert not await _indexed(r, history, salt_text("toy", 0))  # ... and never version 0
    finally:
        await r.aclose()

    # Each replica reloaded once: the reference server reloaded once (to version 1) answers the same.
    async with httpx.AsyncClient(trust_env=False) as http:
        body = {"model_path": str(checkpoint), "weight_version": "1"}
        assert (await http.post(f"{replicas[2].url}/update_weights_from_disk", json=body, timeout=10)).is_success
    expected = await _greedy_logprobs(replicas[2].url)
    assert await _greedy_logprobs(replicas[0].url) == expected
    assert await _greedy_logprobs(replicas[1].url) == expected

    # admission.max_staleness = 1, against the fleet's version: B never ran an update itself.
    await b.client.step(stale)  # one version behind: allowed
    assert await a.client.update_weights(str(checkpoint)) == 2
    with pytest.raises(BridgeError) as refused:
        await b.client.step(stale)
    assert refused.value.code.name == "FAILED_PRECONDITION" and "current version 2" in str(refused.value)
