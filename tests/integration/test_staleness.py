"""Staleness admission (DESIGN invariant 4) through a real client on a real gRPC bridge.

A Step on an episode whose policy version is more than ``admission.max_staleness`` versions behind
the model's current version is refused with FAILED_PRECONDITION naming both versions, counted in
``primerl_staleness_rejections_total``, and changes nothing in the episode; 0 turns the check off.
The toy engine accepts ``UpdateWeights``, so a test moves the version with one cheap call.
"""

from __future__ import annotations

import re

import pytest

from rl_client import AsyncBridgeClient
from rl_client.errors import FailedPreconditionError
from server.app import BridgeServer
from tests.conftest import StartBridge

PROMPT = [1, 4, 30, 31, 32, 2, 5]
SAMPLING = {"max_tokens": 4, "ignore_eos": True, "seed": 1}


def rejections(server: BridgeServer) -> float:
    value = server.metrics.registry.get_sample_value("primerl_staleness_rejections_total", {"model": "toy"})
    return value or 0.0


async def start(start_bridge: StartBridge, max_staleness: int) -> tuple[BridgeServer, AsyncBridgeClient]:
    return await start_bridge(admission={"max_staleness": max_staleness})


async def test_a_step_too_many_versions_behind_is_refused_naming_both_versions(start_bridge: StartBridge) -> None:
    server, client = await start(start_bridge, 2)
    ep = (await client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    await client.step(ep)  # version 0: fresh
    assert await client.update_weights(policy_version=3) == 3

    with pytest.raises(FailedPreconditionError) as info:
        await client.step(ep, [2, 5])
    details = info.value.details
    assert re.search(r"\b0\b", details) and re.search(r"\b3\b", details), details  # the episode's and the current
    assert rejections(server) == 1

    # Nothing of the refused turn was recorded: the trajectory holds the prompt and the first turn only.
    traj = await client.end_episode(ep)
    assert len(traj.turns) == 1
    assert traj.token_ids.tolist()[: len(PROMPT)] == PROMPT
    assert len(traj.token_ids) == len(PROMPT) + 4
    assert set(traj.policy_versions.tolist()) == {0}


async def test_within_the_bound_and_fresh_episodes_are_served(start_bridge: StartBridge) -> None:
    server, client = await start(start_bridge, 2)
    old = (await client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    await client.step(old)
    assert await client.update_weights(policy_version=2) == 2
    turn = await client.step(old, [2, 5])  # exactly max_staleness behind: still admitted
    assert len(turn.token_ids) == 4

    new = (await client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    assert await client.update_weights(policy_version=4) == 4
    with pytest.raises(FailedPreconditionError):
        await client.step(old, [2, 5])  # now 4 behind
    turn = await client.step(new)  # started at version 2: 2 behind, admitted
    assert len(turn.token_ids) == 4
    assert rejections(server) == 1


async def test_zero_turns_the_check_off(start_bridge: StartBridge) -> None:
    server, client = await start(start_bridge, 0)
    ep = (await client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    await client.step(ep)
    assert await client.update_weights(policy_version=50) == 50
    turn = await client.step(ep, [2, 5])
    assert len(turn.token_ids) == 4
    assert rejections(server) == 0
