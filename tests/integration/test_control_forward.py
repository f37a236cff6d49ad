"""Fleet routing with real bridge processes (issue 21, acceptances 3 and 2).

Two fleet bridges on one private Redis over two stand-in engine processes:

* persistence off (the default): an episode started on A and stepped and ended through B (the client pinned to
  the non-owner) is served: B forwards each call to A, and the trajectory B returns holds every turn;
* persistence on, a trainer given the control plane's address (``rl_client.AsyncFleetClient``): the bridge that
  owns its episode is killed with SIGKILL in the middle of a Step (holding the episode's lease); the Step fails
  UNAVAILABLE there once and is sent to the other bridge, which breaks the dead bridge's lease and takes the
  episode over from Redis; the trajectory is exactly what the trainer saw (the cut turn was never written).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from rl_client import AsyncFleetClient
from rl_client.errors import NotFoundError
from server.fleet.service import create_control_server
from tests.integration.fleet_bridge import FleetBridgeProcess, bridge_pair, fleet_env, standins
from tests.integration.redis_proc import PrivateRedis

PROMPT = [1, 4, 30, 31, 32, 2, 5] * 3
SAMPLING = {"max_tokens": 6, "ignore_eos": True, "seed": 2}
LONG = {"max_tokens": 400, "ignore_eos": True, "seed": 4}  # ~4 s at 10 ms a token


@pytest.fixture
def engines() -> Iterator[list[str]]:
    with standins(2, "--token-delay-s", "0.01") as procs:  # 10 ms a token: a long turn can be cut short
        yield [p.url for p in procs]


@pytest.fixture
async def fleet(
    request: pytest.FixtureRequest, redis_server: PrivateRedis, engines: list[str]
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    persistence = getattr(request, "param", "false")
    env = fleet_env(redis_server.url, PRIMERL_PERSISTENCE__ENABLED=persistence)
    async with bridge_pair(engines, env) as pair:
        yield pair


async def test_a_step_sent_to_the_wrong_bridge_is_forwarded_to_its_owner(
    fleet: tuple[FleetBridgeProcess, ...],
) -> None:
    a, b = fleet
    ep = (await a.client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    first = await b.client.step(ep)  # B does not hold it (no persistence): A serves it
    streamed = [t async for chunk in b.client.stream_step(ep, [9, 10]) for t in chunk.token_ids]
    traj = await b.client.end_episode(ep)
    one, two = traj.turns
    assert traj.token_ids[: len(PROMPT)].tolist() == PROMPT
    assert traj.token_ids[one.generation_start : one.end].tolist() == first.token_ids.tolist()
    assert traj.token_ids[one.end : two.generation_start].tolist() == [9, 10]
    assert traj.token_ids[two.generation_start : two.end].tolist() == streamed
    with pytest.raises(NotFoundError):  # ended on its owner: gone everywhere
        await a.client.step(ep)


@pytest.fixture
async def control(redis_server: PrivateRedis) -> AsyncIterator[str]:
    server = create_control_server(redis_server.url)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("fleet", ["true"], indirect=True)
async def test_a_bridge_killed_mid_episode_its_episode_continues_through_another(
    fleet: tuple[FleetBridgeProcess, ...], control: str
) -> None:
    trainer = AsyncFleetClient(control, "toy")  # given the control plane: channels straight to owners
    try:
        started = await trainer.start_episode(PROMPT, sampling=SAMPLING)
        ep = started.episode_id
        first = await trainer.step(ep)
        infos = [await b.client.server_info() for b in fleet]
        (owner,) = [b for b, info in zip(fleet, infos, strict=True) if info.open_episodes == 1]
        running = asyncio.create_task(trainer.step(ep, [9, 10], sampling=LONG))
        await asyncio.sleep(1.0)  # the owner is streaming the turn (it holds the episode's lease) ...
        assert not running.done()
        owner.kill()  # ... when it dies: the trainer's Step is sent once more, to the other bridge
        second = await running
        third = await trainer.step(ep, [11])
        traj = await trainer.end_episode(ep)
        assert trainer.retries == 1  # the one UNAVAILABLE, retried on another bridge
    finally:
        await trainer.close()
    expected = [*PROMPT, *first.token_ids, 9, 10, *second.token_ids, 11, *third.token_ids]
    assert traj.token_ids.tolist() == expected
    assert [t.finish_reason for t in traj.turns] == ["length"] * 3 and len(second.token_ids) == 400
