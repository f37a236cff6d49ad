"""GRPO sampling and async scheduling through a real bridge (toy engine): groups, rewards, staleness.

AC4: in async mode every trained sample's policy version is within ``max_async_level`` of the trainer's,
and a run that forces staleness (weights pushed while a batch waits) sees the stale groups dropped and
counted.
"""

from __future__ import annotations

import asyncio

from envhub import Rubric
from grpo.masks import StalenessFilter, oldest_version
from grpo.pipeline import Pipeline
from grpo.rater import Rollout
from grpo.sampler import Group, GroupSampler, GroupSpec, SamplerStats
from rl_client import AsyncBridgeClient, TurnResult
from tests.conftest import StartBridge


class TwoTurnEnv:
    """Answers the first turn with a fixed observation, ends after the second."""

    def __init__(self, problem: int) -> None:
        self.problem = problem
        self.texts: list[str] = []
        self.generated = 0

    def on_turn(self, turn: TurnResult) -> list[dict[str, str]] | None:
        self.texts.append(turn.text)
        self.generated += turn.usage.generated_tokens
        return [{"role": "tool", "content": "ok"}] if len(self.texts) == 1 else None

    def rollout(self) -> Rollout:
        return Rollout(self.texts, [], None, self.generated)


def length_rater() -> Rubric[Rollout]:
    # a deterministic function of what was sampled, so rewards differ inside a group
    return Rubric.weighted({"len": (lambda r: min(1.0, r.generated_tokens / 16), 1.0)})


def specs(n: int, g: int = 4) -> list[GroupSpec[int]]:
    return [
        GroupSpec(
            prompt=[{"role": "user", "content": f"question {i}"}],
            problem=i,
            group_size=g,
            sampling={"temperature": 1.0, "max_tokens": 12},
            max_turns=2,
        )
        for i in range(n)
    ]


async def test_sampler_returns_rated_groups_with_the_reward_attached(start_bridge: StartBridge) -> None:
    _, client = await start_bridge()
    sampler: GroupSampler[int] = GroupSampler(client, TwoTurnEnv, length_rater(), concurrency=2)
    groups, stats = await sampler.collect(specs(3, g=4))
    assert [len(g.trajectories) for g in groups] == [4, 4, 4]
    for g in groups:
        assert len({t.group_id for t in g.trajectories}) == 1
        assert [t.reward for t in g.trajectories] == g.rewards
        assert g.rewards == [min(1.0, r.generated_tokens / 16) for r in g.rollouts]
        assert all(len(t.turns) == 2 for t in g.trajectories)
        assert all(t.prompt_length == g.trajectories[0].prompt_length for t in g.trajectories)
    assert stats.generated_tokens == sum(g.generated_tokens for g in groups) > 0
    assert stats.rewards == [r for g in groups for r in g.rewards]
    assert not client.open_episodes


async def test_forced_staleness_drops_and_counts_groups(start_bridge: StartBridge) -> None:
    _, client = await start_bridge()
    sampler: GroupSampler[int] = GroupSampler(client, TwoTurnEnv, length_rater())
    stale, _ = await sampler.collect(specs(2, g=3))  # generated at v0
    for _ in range(3):
        version = await client.update_weights()
    fresh, _ = await sampler.collect(specs(2, g=3))
    assert version == 3
    f = StalenessFilter(max_async_level=1)
    verdicts = [f.judge(g.trajectories, trainer_version=version) for g in stale + fresh]
    assert [v.keep for v in verdicts] == [False, False, True, True]
    assert [v.lag for v in verdicts] == [3, 3, 0, 0]
    assert f.stats.groups_dropped == 2 and f.stats.samples_dropped == 6 and f.stats.groups_kept == 2
    # down-weighting keeps them with decay ** (lag - level)
    d = StalenessFilter(max_async_level=1, mode="downweight", decay=0.5)
    assert d.judge(stale[0].trajectories, trainer_version=version).weight == 0.25
    assert d.stats.groups_downweighted == 1


async def _run_pipeline(client: AsyncBridgeClient, level: int, steps: int, train_delay: float) -> dict[str, object]:
    sampler: GroupSampler[int] = GroupSampler(client, TwoTurnEnv, length_rater())
    filt = StalenessFilter(max_async_level=level)
    start = (await client.server_info()).models[0].policy_version
    pipe: Pipeline[tuple[list[Group[int]], SamplerStats]] = Pipeline(level, base_version=start)
    lags: list[int] = []
    trained_versions: list[int] = []

    async def collect(step: int) -> tuple[list[Group[int]], SamplerStats]:
        return await sampler.collect(specs(1, g=2))

    async def train(step: int, batch: tuple[list[Group[int]], SamplerStats]) -> int:
        groups, _ = batch
        for g in groups:
            verdict = filt.judge(g.trajectories, pipe.version)
            lags.append(verdict.lag)
            for t in g.trajectories:
                v = oldest_version(t)
                assert v is not None and pipe.version - v <= level
        trained_versions.append(pipe.version)
        await asyncio.sleep(train_delay)  # the "optimizer step"; rollouts of the next step run meanwhile
        return await client.update_weights()

    await pipe.run(0, steps, collect, train)
    return {"lags": lags, "trained": trained_versions, "admitted": pipe.admitted_at, "filter": filt}


async def test_async_mode_stays_within_max_async_level(start_bridge: StartBridge) -> None:
    _, client = await start_bridge(engine={"toy": {"token_delay_s": 0.002}})
    sync = await _run_pipeline(client, level=0, steps=4, train_delay=0.05)
    assert sync["lags"] == [0, 0, 0, 0]
    assert sync["trained"] == [0, 1, 2, 3]  # trained at the version it was collected with
    for level in (1, 2):
        r = await _run_pipeline(client, level=level, steps=6, train_delay=0.3)
        lags = r["lags"]
        assert isinstance(lags, list) and max(lags) <= level
        assert max(lags) >= 1, "async mode never overlapped rollouts with training"
        admitted = r["admitted"]
        assert isinstance(admitted, dict)
        base = r["trained"][0]  # type: ignore[index]
        assert all(v >= base + s - level for s, v in admitted.items())
        f = r["filter"]
        assert isinstance(f, StalenessFilter) and f.stats.groups_dropped == 0
