"""``RolloutManager``: collects groups of variable-length trajectories through the bridge, in parallel.

One batch = ``num_prompts`` groups of ``group_size`` members. Group ``k`` of step ``s`` is task
``s * num_prompts + k`` of the environment (the sampler position is the step: a resumed run continues with
the tasks an uninterrupted one would see). Each group is one ``StartEpisode(group_size=G)`` (the engine
prefills the prompt once); each member forks the environment and runs turns until it ends:
``BaseEnvironment.tool_loop`` environments through the Env Hub's ``ToolLoop`` (tool calls executed by the
environment), the others by handing each turn's text to ``env.step``. ``EndEpisode`` attaches the graded
reward and returns the token record.

Seeds: every turn is sampled with its own seed derived from (``seed``, step, group, member, turn), so a
batch is reproducible whatever the order episodes run in. At most ``max_concurrent`` episodes run at once
(1 makes the engine's batching, hence every float, identical between runs); a progress bar counts episodes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from envhub import FinalAnswer, ToolLoop
from grpo.environments import BaseEnvironment, State
from grpo.inference import message_dicts
from rl_client import AsyncBridgeClient, BridgeClient
from rl_client import Trajectory as TokenRecord


class RolloutConfig(BaseModel):
    """How a batch is collected."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int = Field(1, ge=1, description="Groups (prompts) per batch.")
    group_size: int = Field(4, ge=1, description="Completions sampled per prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (the trainer scores at the same one).")
    max_tokens: int = Field(32, ge=1, description="Tokens sampled per turn at most.")
    turn_max_tokens: list[int] = Field(default_factory=list, description="Per-turn max_tokens (index = turn).")
    max_concurrent: int = Field(8, ge=1, description="Episodes in flight at most (1 = bit-reproducible batching).")
    seed: int = Field(0, ge=0, description="Base seed of every turn's sampling seed.")
    progress_bar: bool = Field(False, description="Show a progress bar over episodes.")


@dataclass
class Trajectory:
    """One finished episode: what the environment saw and graded, and the bridge's exact token record."""

    group: int  # index of the group in the run (step * num_prompts + k)
    member: int
    reward: float
    state: State
    tokens: TokenRecord
    seconds: float = 0.0

    @property
    def texts(self) -> list[str]:
        return self.state.turns

    @property
    def generated_tokens(self) -> int:
        return int(np.count_nonzero(self.tokens.loss_mask))


@dataclass
class RolloutStats:
    episodes: int = 0
    mean_reward: float = 0.0
    std_reward: float = 0.0
    mean_turns: float = 0.0
    mean_generated_tokens: float = 0.0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: Sequence[Trajectory], seconds: float) -> RolloutStats:
        rewards = np.array([t.reward for t in batch]) if batch else np.zeros(1)
        gen = sum(t.generated_tokens for t in batch)
        return cls(
            episodes=len(batch),
            mean_reward=float(rewards.mean()),
            std_reward=float(rewards.std()),
            mean_turns=float(np.mean([len(t.texts) for t in batch])) if batch else 0.0,
            mean_generated_tokens=gen / max(1, len(batch)),
            seconds=seconds,
            tokens_per_s=gen / seconds if seconds > 0 else 0.0,
        )

    def row(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """The figures a step's record carries about its rollouts: these statistics and the mean of every reward
        component the environment graded (``reward/<name>``)."""
        row = {"rollout_s": self.seconds, "tokens_per_s": self.tokens_per_s, "mean_turns": self.mean_turns}
        row["reward_std"] = self.std_reward
        components = [t.state.info.get("components", {}) for t in batch]
        for key in components[0] if components else {}:
            row[f"reward/{key}"] = float(np.mean([c.get(key, 0.0) for c in components]))
        return row


def turn_seed(*parts: int) -> int:
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63


class RolloutManager:
    """Parallel collection of trajectory groups from ``environment`` through ``inference``'s bridge."""

    def __init__(self, inference: Any, environment: BaseEnvironment, config: RolloutConfig | None = None) -> None:
        if getattr(inference, "client", None) is None:
            raise ValueError(
                "RolloutManager needs an InferenceModule backed by a bridge (InferenceModule('host:port'))"
            )
        self.inference = inference
        self.environment = environment
        self.config = config or RolloutConfig()
        self.last_stats = RolloutStats()

    @property
    def client(self) -> BridgeClient:
        return self.inference.client

    def sampling(self, turn: int, seed: int) -> Mapping[str, Any]:
        c = self.config
        max_tokens = c.turn_max_tokens[turn] if turn < len(c.turn_max_tokens) else c.max_tokens
        return {"temperature": c.temperature, "max_tokens": max_tokens, "seed": seed}

    async def _member(
        self, client: AsyncBridgeClient, episode_id: str, group: int, member: int, step: int
    ) -> Trajectory:
        t0 = time.perf_counter()
        env = self.environment.fork()
        await env.reset(seed=group)
        loop = ToolLoop(env) if env.tool_loop else None
        observation: list[dict[str, str]] | None = None
        generated = 0
        for turn in range(env.max_turns + (loop.config.max_tool_calls if loop else 0)):
            sampling = self.sampling(turn, turn_seed(self.config.seed, step, group, member, turn))
            result = await client.step(episode_id, observation, sampling=sampling)
            generated += result.usage.generated_tokens
            if loop is not None:
                decision = await loop.on_turn(result.text)
                done, obs = not decision.should_continue, decision.observation
            else:
                stepped = await env.step(FinalAnswer(result.text))
                done, obs = stepped.done, stepped.observation
            if done:
                break
            observation = message_dicts(obs)
        state = env.current
        state.info["generated"] = generated
        if not state.done:  # out of turns: grade what there is
            state.done, state.reward = True, float(env.score(state))
        tokens = await client.end_episode(episode_id, reward=state.reward)
        return Trajectory(group, member, state.reward, state, tokens, time.perf_counter() - t0)

    async def _group(
        self, client: AsyncBridgeClient, group: int, step: int, sem: asyncio.Semaphore
    ) -> list[Trajectory]:
        opening = await self.environment.fork().reset(seed=group)
        started = await client.start_episode(
            message_dicts(opening.messages),
            sampling=self.sampling(0, turn_seed(self.config.seed, step, group)),
            group_size=self.config.group_size,
            tools=self.environment.prompt_tool_schemas(),
        )

        async def run(member: int, episode_id: str) -> Trajectory:
            async with sem:
                return await self._member(client, episode_id, group, member, step)

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(run(i, e)) for i, e in enumerate(started.episode_ids)]
        except BaseException:
            for e in started.episode_ids:
                if e in client.open_episodes:
                    await client.discard_episode(e, timeout=10.0)
            raise
        return [t.result() for t in tasks]

    async def acollect(self, step: int) -> list[Trajectory]:
        """The batch of ``step`` (runs on the bridge client's event loop)."""
        c = self.config
        client = self.client.aio
        sem = asyncio.Semaphore(c.max_concurrent)
        groups = range(step * c.num_prompts, (step + 1) * c.num_prompts)
        bar = None
        if c.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=c.num_prompts * c.group_size, desc=f"rollouts (step {step})", unit="ep", leave=False)
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._group(client, g, step, sem)) for g in groups]
                if bar is not None:
                    for t in tasks:
                        t.add_done_callback(lambda _t: bar.update(c.group_size))
        finally:
            if bar is not None:
                bar.close()
        batch = [traj for t in tasks for traj in t.result()]
        self.last_stats = RolloutStats.of(batch, time.perf_counter() - t0)
        return batch

    def collect(self, step: int = 0) -> list[Trajectory]:
        """The batch of ``step``, synchronously; statistics in ``last_stats``."""
        return self.client.run(self.acollect(step))


__all__ = ["RolloutConfig", "RolloutManager", "RolloutStats", "Trajectory", "turn_seed"]
