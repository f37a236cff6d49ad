"""Every status code the bridge promises, produced through a real client on a real server.

Each bad request must fail with its own code and an actionable message, and leave nothing
half-written.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from rl_client import AsyncBridgeClient, BridgeError
from rl_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnimplementedError,
)
from server.app import BridgeServer
from tests.conftest import StartBridge

Bridge = tuple[BridgeServer, AsyncBridgeClient]
PROMPT = [1, 4, 30, 31, 32, 2, 5]
SLOW = {"engine": {"toy": {"token_delay_s": 0.01}}}


async def expect(code: type[BridgeError], coro: object, *fragments: str) -> BridgeError:
    with pytest.raises(code) as info:
        await coro  # type: ignore[misc]
    for fragment in fragments:
        assert fragment in info.value.details, info.value.details
    return info.value


async def end_when_idle(client: AsyncBridgeClient, episode_id: str):  # type: ignore[no-untyped-def]
    """EndEpisode once the server has processed a cancelled Step (bounded wait)."""
    for _ in range(200):
        try:
            return await client.end_episode(episode_id)
        except FailedPreconditionError:
            await asyncio.sleep(0.01)
    raise AssertionError("episode stayed busy after its Step was cancelled")


@pytest.mark.parametrize(
    ("prompt", "sampling", "fragments"),
    [
        ([1, -1], None, ("prompt_token_ids[1] = -1", "outside the vocabulary [0, 512)")),
        ([1, 512], None, ("prompt_token_ids[1] = 512",)),
        ([], None, ("prompt is empty",)),
        (PROMPT, {"temperature": -1.0}, ("sampling.temperature",)),
        (PROMPT, {"temperature": math.nan}, ("sampling.temperature",)),
        (PROMPT, {"temperature": 1e-30}, ("sampling.temperature must be 0 (greedy) or at least 1e-05",)),
        (PROMPT, {"top_p": 0.0}, ("sampling.top_p must be in (0, 1]",)),
        (PROMPT, {"top_p": 1.5}, ("sampling.top_p",)),
        (PROMPT, {"top_k": -3}, ("sampling.top_k must be >= 0",)),
        (PROMPT, {"max_tokens": 0}, ("sampling.max_tokens must be >= 1",)),
        (PROMPT, {"max_tokens": 9000}, ("exceeds the limit of 8192 tokens per turn",)),
        (PROMPT, {"stop_token_ids": [7, 600]}, ("sampling.stop_token_ids[1] = 600",)),
        (PROMPT, {"seed": 2**64 - 1}, ("sampling.seed must be in [0, 2**63)",)),
        ([{"role": "robot", "content": "hi"}], None, ("messages[0].role = 'robot'",)),
    ],
)
async def test_start_episode_invalid_argument(bridge: Bridge, prompt, sampling, fragments) -> None:  # type: ignore[no-untyped-def]
    server, client = bridge
    await expect(InvalidArgumentError, client.start_episode(prompt, sampling=sampling), *fragments)
    assert len(server.bridge.store) == 0  # nothing half-created


async def test_unknown_model_group_size_and_context_window(start_bridge: StartBridge) -> None:
    server, client = await start_bridge(engine={"toy": {"max_model_len": 64}}, admission={"max_group_size": 8})
    await expect(InvalidArgumentError, client.start_episode(PROMPT, model="gpt-9"), "unknown model 'gpt-9'", "'toy'")
    await expect(InvalidArgumentError, client.start_episode(PROMPT, group_size=9), "group_size must be in [1, 8]")
    await expect(InvalidArgumentError, client.start_episode(PROMPT, group_size=-2), "group_size")
    await expect(InvalidArgumentError, client.start_episode([8] * 64), "context window of 64 tokens")
    await expect(InvalidArgumentError, client.start_episode(PROMPT, sampling={"max_tokens": 64}), "context window")
    assert len(server.bridge.store) == 0


async def test_bad_step_leaves_episode_unchanged(bridge: Bridge) -> None:
    _, client = bridge
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 4})).episode_id
    await client.step(ep)
    await expect(InvalidArgumentError, client.step(ep, [9, 10, 99999]), "observation_token_ids[2] = 99999")
    await expect(InvalidArgumentError, client.step(ep, sampling={"top_p": 2.0}), "sampling.top_p")
    await expect(InvalidArgumentError, client.step(ep, [{"role": "", "content": "x"}]), "messages[0].role")
    traj = await client.end_episode(ep)
    assert len(traj.turns) == 1 and len(traj) == traj.turns[0].end  # no stray observation, no extra turn


async def test_not_found(bridge: Bridge) -> None:
    _, client = bridge
    await expect(NotFoundError, client.step("ep-nope"), "'ep-nope' does not exist")
    ep = (await client.start_episode(PROMPT)).episode_id
    await client.end_episode(ep)
    await expect(NotFoundError, client.end_episode(ep), "already ended")
    await expect(NotFoundError, client.step(ep))


async def test_end_episode_reward_validation(bridge: Bridge) -> None:
    _, client = bridge
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 3})).episode_id
    await client.step(ep)
    await expect(InvalidArgumentError, client.end_episode(ep, reward=math.inf), "rewards[0] = inf")
    await expect(InvalidArgumentError, client.end_episode(ep, turn_rewards=[1.0, 2.0]), "has 2 entries", "1 turns")
    traj = await client.end_episode(ep, reward=[1.0, 0.5], turn_rewards=[0.25])  # still there after bad requests
    assert traj.rewards == [1.0, 0.5] and traj.turn_rewards == [0.25]


async def test_concurrent_step_is_failed_precondition(start_bridge: StartBridge) -> None:
    _, client = await start_bridge(**SLOW)
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 40, "ignore_eos": True})).episode_id
    stream = client.stream_step(ep)
    await anext(stream)
    await expect(FailedPreconditionError, client.step(ep), "already has a Step in progress")
    await expect(FailedPreconditionError, client.end_episode(ep), "Step in progress")
    rest = [c async for c in stream]
    assert rest[-1].done is not None and rest[-1].done.finish_reason == "length"


async def test_admission_limits_resource_exhausted(start_bridge: StartBridge) -> None:
    server, client = await start_bridge(admission={"max_episodes": 3, "max_tokens_per_episode": 20})
    a = await client.start_episode(PROMPT, group_size=2, sampling={"max_tokens": 100, "ignore_eos": True})
    await client.start_episode(PROMPT)
    await expect(ResourceExhaustedError, client.start_episode(PROMPT), "limit of 3 open episodes")
    await expect(ResourceExhaustedError, client.start_episode(PROMPT, group_size=2))
    turn = await client.step(a.episode_ids[0])
    assert turn.finish_reason == "length" and len(turn.token_ids) == 20 - len(PROMPT)  # capped at the budget
    await expect(ResourceExhaustedError, client.step(a.episode_ids[0], [9]), "limit of 20 tokens per episode")
    assert len(server.bridge.store) == 3


async def test_client_cancel_mid_stream_keeps_partial_tokens(start_bridge: StartBridge) -> None:
    server, client = await start_bridge(**SLOW)
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 500, "ignore_eos": True})).episode_id
    received: list[int] = []
    stream = client.stream_step(ep)
    async for chunk in stream:
        received += chunk.token_ids
        if len(received) >= 5:
            break
    await stream.aclose()  # the trainer walks away: the call is cancelled
    traj = await end_when_idle(client, ep)
    (turn,) = traj.turns
    kept = traj.token_ids[turn.generation_start : turn.end].tolist()
    assert turn.finish_reason == "abort"
    assert kept[: len(received)] == received and 5 <= len(kept) < 500
    assert traj.loss_mask[turn.generation_start : turn.end].all()
    assert server.bridge.engines[0].counters.generated_tokens < 500  # generation really stopped


async def test_deadline_expiry_keeps_partial_tokens(start_bridge: StartBridge) -> None:
    _, client = await start_bridge(**SLOW)
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 500, "ignore_eos": True})).episode_id
    err = await expect(DeadlineExceededError, client.step(ep, timeout=0.3))
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    traj = await end_when_idle(client, ep)
    (turn,) = traj.turns
    assert turn.finish_reason == "abort" and 0 < turn.end - turn.generation_start < 500


async def test_update_weights_errors(start_bridge: StartBridge) -> None:
    _, client = await start_bridge()
    await client.update_weights("", policy_version=3)
    await expect(
        InvalidArgumentError, client.update_weights("", policy_version=3), "greater than the current version 3"
    )
    await expect(InvalidArgumentError, client.update_weights("", model="other"), "unknown model")
    _, fixed = await start_bridge(engine={"toy": {"supports_weight_updates": False}})
    await expect(UnimplementedError, fixed.update_weights("/ckpt"), "cannot load new weights")
