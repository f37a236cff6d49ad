"""A trainer's view of the bridge: episodes, turns, trajectories, groups, weights."""

from __future__ import annotations

import asyncio
import tracemalloc

import numpy as np
import pytest

from engines.launch import free_port
from engines.toy import ASSISTANT, END
from rl_client import AsyncBridgeClient, BridgeClient, run_episodes
from server import service
from server.app import BridgeServer

Bridge = tuple[BridgeServer, AsyncBridgeClient]

PROMPT = [1, 4, 30, 31, 32, 2, 5]
OBS = [[2, 4, 40, 41, 2, 5], [2, 6, 50, 51, 52, 2, 5]]


async def test_three_turn_trajectory_is_prompt_then_sampled_and_observations(bridge: Bridge) -> None:
    server, client = bridge
    started = await client.start_episode(PROMPT, sampling={"temperature": 1.0, "max_tokens": 12, "seed": 7})
    ep = started.episode_id
    turns = [await client.step(ep)]
    for obs in OBS:
        turns.append(await client.step(ep, obs))
    traj = await client.end_episode(ep, reward=0.5)

    expected = list(PROMPT) + list(turns[0].token_ids)
    for obs, turn in zip(OBS, turns[1:], strict=True):
        expected += obs + list(turn.token_ids)
    assert traj.token_ids.tolist() == expected
    sampled = np.zeros(len(expected), dtype=bool)
    for t in traj.turns:
        sampled[t.generation_start : t.end] = True
    assert traj.loss_mask.tolist() == sampled.tolist()
    assert np.isfinite(traj.logprobs).tolist() == sampled.tolist()
    assert (traj.logprobs[sampled] <= 0).all()
    assert traj.policy_versions.tolist() == [0] * len(expected)
    assert traj.prompt_length == len(PROMPT)
    assert [t.generation_start - t.observation_start for t in traj.turns] == [0, len(OBS[0]), len(OBS[1])]
    assert traj.origin_names()[: len(PROMPT)] == ["prompt"] * len(PROMPT)
    assert traj.rewards == [0.5]
    for turn, info in zip(turns, traj.turns, strict=True):
        assert traj.token_ids[info.generation_start : info.end].tolist() == turn.token_ids.tolist()
        np.testing.assert_array_equal(traj.logprobs[info.generation_start : info.end], turn.logprobs)
        assert info.finish_reason == turn.finish_reason in ("stop", "length")
        assert turn.usage.generated_tokens == len(turn.token_ids) <= 12
        assert turn.usage.prompt_tokens == info.generation_start
    assert not server.bridge.store._episodes  # freed


@pytest.mark.parametrize(("interval_ms", "coalesced"), [(0.0, False), (1000.0, True)])
async def test_streamed_turn_equals_unstreamed_turn(start_bridge, interval_ms: float, coalesced: bool) -> None:  # type: ignore[no-untyped-def]
    # The toy emits one chunk per token here, so what is measured is the bridge's coalescing.
    _, client = await start_bridge(server={"stream_interval_ms": interval_ms}, engine={"toy": {"yield_every": 1}})
    sampling = {"seed": 3, "max_tokens": 20, "ignore_eos": True}
    a = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
    b = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
    chunks = [c async for c in client.stream_step(a)]
    whole = await client.step(b)
    assert chunks[-1].done is not None
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == whole.token_ids.tolist() == chunks[-1].done.token_ids.tolist()
    assert [lp for c in chunks for lp in c.logprobs] == whole.logprobs.tolist()
    assert chunks[-1].done.text == whole.text != ""
    assert len(streamed) == 20
    if coalesced:  # first token at once, the rest held back within the interval and sent with `done`
        assert [len(c.token_ids) for c in chunks] == [1, 19]
    else:
        assert [len(c.token_ids) for c in chunks] == [1] * 20  # one chunk per token, the last with `done`


async def test_a_streamed_step_holds_what_it_has_not_sent_and_reads_the_last_turn_from_the_episode(
    start_bridge,  # type: ignore[no-untyped-def]
) -> None:
    # One chunk per token. What the servicer holds while it streams must not grow with what it has already
    # sent (an env Step streams a whole trajectory); its final chunk's text is the last turn's, as before.
    server, client = await start_bridge(server={"stream_interval_ms": 0.0}, engine={"toy": {"yield_every": 1}})
    sampling = {"seed": 5, "max_tokens": 3000, "ignore_eos": True}
    ep = (await client.start_episode(PROMPT, sampling={**sampling, "max_tokens": 4})).episode_id
    first = await client.step(ep)
    held: dict[int, int] = {}
    tracemalloc.start()
    try:
        chunks = []
        async for c in client.stream_step(ep, OBS[0], sampling=sampling):
            chunks.append(c)
            if len(chunks) in (300, 2900):  # the servicer is suspended at this chunk's yield
                stats = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, service.__file__)])
                held[len(chunks)] = sum(s.size for s in stats.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert held[2900] - held[300] < 16 * 1024, held  # before: every token streamed, in four lists
    traj = await client.end_episode(ep)
    turn = traj.turns[-1]
    streamed = [t for c in chunks for t in c.token_ids]
    assert len(streamed) == 3000 and streamed == traj.token_ids[turn.generation_start : turn.end].tolist()
    assert chunks[-1].done.text == server.bridge.tokenizer.decode(streamed) != first.text
    assert chunks[-1].done.token_ids.tolist() == streamed and len(first.token_ids) == 4


async def test_chat_messages_are_rendered_append_only(bridge: Bridge) -> None:
    _, client = bridge
    ep = await client.start_episode([{"role": "user", "content": "what is the answer"}], sampling={"max_tokens": 5})
    t1 = await client.step(ep.episode_id, sampling={"ignore_eos": True})
    await client.step(ep.episode_id, [{"role": "tool", "content": "result ten"}])
    traj = await client.end_episode(ep.episode_id)
    head = traj.token_ids[: traj.prompt_length].tolist()
    assert head[-1] == ASSISTANT and ep.prompt_tokens == len(head)
    second = traj.turns[1]
    obs = traj.token_ids[second.observation_start : second.generation_start].tolist()
    # The first turn ended on max_tokens, so the renderer closes it before the tool message.
    assert t1.finish_reason == "length"
    assert obs[0] == END and obs[-1] == ASSISTANT
    assert traj.origin_names()[second.observation_start : second.generation_start] == ["env"] * len(obs)


async def test_grpo_group_opens_co_located_episodes_with_distinct_samples(bridge: Bridge) -> None:
    _, client = bridge
    started = await client.start_episode(PROMPT, group_size=4, sampling={"seed": 11, "max_tokens": 16})
    assert len(started.episode_ids) == len(set(started.episode_ids)) == 4
    turns = await asyncio.gather(*(client.step(e) for e in started.episode_ids))
    trajs = [await client.end_episode(e, reward=float(i)) for i, e in enumerate(started.episode_ids)]
    assert {t.group_id for t in trajs} == {started.group_id}
    assert [t.group_index for t in trajs] == [0, 1, 2, 3]
    assert len({tuple(t.token_ids.tolist()) for t in turns}) > 1  # member i samples with seed + i
    for t in trajs:
        assert t.token_ids[: len(PROMPT)].tolist() == PROMPT


async def test_same_seed_reproduces_tokens(bridge: Bridge) -> None:
    _, client = bridge
    runs = []
    for seed in (5, 5, 6):
        ep = await client.start_episode(PROMPT, sampling={"seed": seed, "max_tokens": 24, "ignore_eos": True})
        runs.append((await client.step(ep.episode_id)).token_ids.tolist())
        await client.discard_episode(ep.episode_id)
    assert runs[0] == runs[1] != runs[2]


async def test_update_weights_bumps_version_recorded_per_token(bridge: Bridge) -> None:
    _, client = bridge
    ep = (await client.start_episode(PROMPT, sampling={"seed": 1, "max_tokens": 8, "temperature": 0})).episode_id
    before = await client.step(ep)
    assert await client.update_weights("") == 1
    after = await client.step(ep, OBS[0])
    assert (before.policy_version, after.policy_version) == (0, 1)
    traj = await client.end_episode(ep)
    t0, t1 = traj.turns
    assert set(traj.policy_versions[t0.generation_start : t0.end].tolist()) == {0}
    assert set(traj.policy_versions[t1.observation_start : t1.end].tolist()) == {1}
    assert await client.update_weights("", policy_version=5) == 5
    info = await client.server_info()
    assert info.models[0].policy_version == 5


async def test_server_info_and_limits(bridge: Bridge) -> None:
    _, client = bridge
    info = await client.server_info()
    assert info.models[0].engine == "toy" and info.models[0].vocab_size == 512
    assert info.models[0].has_tokenizer and list(info.models[0].eos_token_ids) == [END]
    assert info.limits.max_episodes == 10_000


async def test_run_episodes_bounded_concurrency_in_order(bridge: Bridge) -> None:
    server, client = bridge
    peak = 0

    async def rollout(c: AsyncBridgeClient, seed: int) -> int:
        nonlocal peak
        ep = (await c.start_episode(PROMPT, sampling={"seed": seed, "max_tokens": 4})).episode_id
        peak = max(peak, len(server.bridge.store))
        await c.step(ep)
        traj = await c.end_episode(ep)
        return int(traj.token_ids.shape[0]) * 1000 + seed

    results = await run_episodes(client, range(40), rollout, concurrency=8)
    assert [r % 1000 for r in results] == list(range(40))
    assert 1 < peak <= 8


async def test_sync_client_and_session_cleanup(bridge: Bridge) -> None:
    server, _ = bridge

    def trainer() -> None:  # a plain synchronous trainer, on its own thread like a real one
        with BridgeClient(f"127.0.0.1:{server.port}") as client:
            ep = client.start_episode(PROMPT, sampling={"max_tokens": 6})
            chunks = list(client.stream_step(ep.episode_id))
            assert chunks[-1].done is not None
            client.start_episode(PROMPT, group_size=3)
            assert len(client.open_episodes) == 4
            assert len(server.bridge.store) == 4

    await asyncio.to_thread(trainer)
    assert len(server.bridge.store) == 0  # the client freed what it left open


async def test_client_retries_until_the_server_is_up(start_bridge) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=20)

    async def late_start() -> None:
        await asyncio.sleep(0.4)
        await start_bridge(server={"port": port})

    starter = asyncio.create_task(late_start())
    try:
        started = await client.start_episode(PROMPT)
        assert started.episode_id.startswith("ep-")
    finally:
        await starter
        await client.close()


async def test_sampling_merges_server_defaults_then_episode_then_step(start_bridge) -> None:  # type: ignore[no-untyped-def]
    """Every sampling field may have a server default; the episode's values override it, a Step's override both."""
    server, client = await start_bridge(sampling={"min_p": 0.3, "top_k": 7, "max_tokens": 5})
    ep = (await client.start_episode(PROMPT, sampling={"top_k": 3})).episode_id
    episode = server.bridge.store.peek(ep)
    assert (episode.sampling.min_p, episode.sampling.top_k, episode.sampling.max_tokens) == (0.3, 3, 5)
    turn = await client.step(ep, sampling={"min_p": 0.0, "max_tokens": 2, "ignore_eos": True})
    assert len(turn.token_ids) == 2  # the Step's max_tokens, not the server's 5
    assert episode.sampling.min_p == 0.3  # a Step's override lasts one turn


async def test_reload_weights_goes_back_to_the_base_weights_as_a_new_version(start_bridge) -> None:  # type: ignore[no-untyped-def]
    server, client = await start_bridge(engine={"type": "toy", "toy": {"supports_weight_updates": True}})
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}

    async def sample() -> list[int]:
        ep = (await client.start_episode(PROMPT, sampling=greedy)).episode_id
        return list((await client.step(ep)).token_ids)

    base = await sample()
    assert await client.update_weights() == 1
    trained = await sample()
    assert trained != base  # the toy's update perturbs its tables
    assert await server.bridge.reload_weights() == 2  # a new version: KV of the trained weights is never reused
    assert await sample() == base
