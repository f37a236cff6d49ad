"""Prompts -> GRPO groups through the bridge: ``StartEpisode(group_size=G)``, a user-supplied environment
loop per member, rewards from a rater (an ``envhub.Rubric`` of ``Rollout`` graders), ``EndEpisode`` with the
reward, trajectories back.

Invariants
----------
* One ``StartEpisode`` per group, so the engine co-locates the group and prefills its prompt once.
* Rewards are rated per group (``Rubric.rate_group``) after every member finished, then attached by
  ``EndEpisode``; the returned ``Trajectory`` therefore carries the reward the trainer uses.
* A failure in any member discards the group's open episodes and is raised (no partial groups).
* At most ``concurrency`` groups are in flight; ``progress`` shows a tqdm bar over groups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from envhub import Rubric
from grpo.rater import Rollout
from rl_client import AsyncBridgeClient, Trajectory, TurnResult, run_episodes

P = TypeVar("P")


class EpisodeEnv(Protocol):
    """One member's environment: sees each sampled turn, answers with an observation or ends."""

    def on_turn(self, turn: TurnResult) -> list[dict[str, str]] | None:
        """Observation messages for the next turn, or None when the episode is over."""

    def rollout(self) -> Rollout:
        """The finished episode for the rater."""


@dataclass(frozen=True)
class GroupSpec(Generic[P]):
    """A prompt to sample ``group_size`` completions of."""

    prompt: Sequence[Mapping[str, str]] | Sequence[int]
    problem: P
    group_size: int
    sampling: Mapping[str, Any]
    tools: Sequence[Mapping[str, Any]] = ()
    turn_sampling: Sequence[Mapping[str, Any] | None] = ()  # per-turn overrides (index = turn)
    max_turns: int = 4


@dataclass
class Group(Generic[P]):
    spec: GroupSpec[P]
    trajectories: list[Trajectory]
    rollouts: list[Rollout]
    rewards: list[float]
    turns: list[list[TurnResult]]
    start_version: int
    seconds: float

    @property
    def generated_tokens(self) -> int:
        return sum(t.usage.generated_tokens for member in self.turns for t in member)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.usage.prompt_tokens for member in self.turns for t in member)

    @property
    def cached_tokens(self) -> int:
        return sum(t.usage.cached_tokens for member in self.turns for t in member)


@dataclass
class SamplerStats:
    groups: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    rewards: list[float] = field(default_factory=list)

    @property
    def kv_reuse(self) -> float:
        """Fraction of prompt tokens (all turns) served from KV the engine already held."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class GroupSampler(Generic[P]):
    """Collects GRPO groups: ``env_factory(problem)`` builds one ``EpisodeEnv`` per member."""

    def __init__(
        self,
        client: AsyncBridgeClient,
        env_factory: Callable[[P], EpisodeEnv],
        rater: Rubric[Rollout],
        concurrency: int = 4,
    ) -> None:
        self.client = client
        self.env_factory = env_factory
        self.rater = rater
        self.concurrency = concurrency

    async def _member(self, episode_id: str, spec: GroupSpec[P]) -> tuple[EpisodeEnv, list[TurnResult]]:
        env = self.env_factory(spec.problem)
        turns: list[TurnResult] = []
        observation: list[dict[str, str]] | None = None
        for i in range(spec.max_turns):
            sampling = spec.turn_sampling[i] if i < len(spec.turn_sampling) else None
            turn = await self.client.step(episode_id, observation, sampling=sampling)
            turns.append(turn)
            observation = env.on_turn(turn)
            if observation is None:
                break
        return env, turns

    async def collect_group(self, client: AsyncBridgeClient, spec: GroupSpec[P]) -> Group[P]:
        t0 = time.perf_counter()
        started = await client.start_episode(
            spec.prompt, sampling=spec.sampling, group_size=spec.group_size, tools=spec.tools
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._member(e, spec), name=f"member-{e}") for e in started.episode_ids]
        except BaseException:
            for e in started.episode_ids:
                if e in client.open_episodes:
                    await client.discard_episode(e, timeout=10.0)
            raise
        members = [t.result() for t in tasks]
        rollouts = [env.rollout() for env, _ in members]
        rewards = self.rater.rate_group(rollouts)
        trajectories = [
            await client.end_episode(e, reward=r) for e, r in zip(started.episode_ids, rewards, strict=True)
        ]
        return Group(
            spec=spec,
            trajectories=trajectories,
            rollouts=rollouts,
            rewards=rewards,
            turns=[turns for _, turns in members],
            start_version=started.policy_version,
            seconds=time.perf_counter() - t0,
        )

    async def collect(
        self, specs: Sequence[GroupSpec[P]], progress: bool | str = False
    ) -> tuple[list[Group[P]], SamplerStats]:
        t0 = time.perf_counter()
        groups = await run_episodes(
            self.client, specs, self.collect_group, concurrency=self.concurrency, progress=progress
        )
        stats = SamplerStats(groups=len(groups), seconds=time.perf_counter() - t0)
        for g in groups:
            stats.generated_tokens += g.generated_tokens
            stats.prompt_tokens += g.prompt_tokens
            stats.cached_tokens += g.cached_tokens
            stats.rewards += g.rewards
        return groups, stats


__all__ = ["EpisodeEnv", "Group", "GroupSampler", "GroupSpec", "SamplerStats"]
