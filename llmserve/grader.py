"""Deterministic per-task grades in [0, 1], by replaying an episode log.

``grade(log)`` replays the log's actions on the simulator (task + seed fix the workload), checks
that the episode is complete and, when the log carries rewards, that they match the replay, then
normalises its return ``R`` between two documented policies run on the same task and seed:

    score = clip(0.5 * (R - R_floor) / (R_ref - R_floor), 0, 1)

``R_floor`` is ``RandomAgent(seed)``'s return and ``R_ref`` ``HeuristicAgent``'s: the random floor
scores 0, the heuristic reference 0.5, and a policy that beats the heuristic by as much as the
heuristic beats random scores 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pydantic import ValidationError

from llmserve.agents import make_agent
from llmserve.baselines import Agent
from llmserve.episode import Episode
from llmserve.models import EpisodeLog, ServeAction, action_fields
from llmserve.tasks import get_task


class EpisodeLogError(ValueError):
    """A log that cannot be graded: unfinished, malformed, or not what its replay produces."""


@dataclass(frozen=True)
class Grade:
    task_id: str
    seed: int
    score: float
    episode_return: float
    floor_return: float
    reference_return: float


def run_agent(agent: Agent, task_id: str, seed: int) -> EpisodeLog:
    """A full episode of ``agent``; its log."""
    ep = Episode(get_task(task_id), seed)
    obs = ep.initial_observation()
    log = EpisodeLog(task_id=task_id, seed=seed)
    while not ep.done:
        action = agent.act(obs)
        obs = ep.step(action)
        log.actions.append(action_fields(action))
        log.rewards.append(float(obs.reward or 0.0))
    return log


def replay_return(log: EpisodeLog) -> float:
    spec = get_task(log.task_id)
    if len(log.actions) != spec.episode_length:
        raise EpisodeLogError(
            f"episode not finished: {len(log.actions)} of {spec.episode_length} steps of {log.task_id!r}"
        )
    ep = Episode(spec, log.seed)
    for i, fields in enumerate(log.actions):
        try:
            action = ServeAction(**fields)
        except ValidationError as exc:
            raise EpisodeLogError(f"action {i}: {exc.errors()[0]['msg']}") from exc
        reward = float(ep.step(action).reward or 0.0)
        if log.rewards and (len(log.rewards) != len(log.actions) or log.rewards[i] != reward):
            raise EpisodeLogError(f"step {i}: logged reward does not match the replay")
    return ep.total_reward


@lru_cache(maxsize=256)
def _bounds(task_id: str, seed: int) -> tuple[float, float]:
    floor = sum(run_agent(make_agent("random", seed), task_id, seed).rewards)
    ref = sum(run_agent(make_agent("heuristic"), task_id, seed).rewards)
    return floor, ref


def grade(log: EpisodeLog) -> Grade:
    ret = replay_return(log)
    floor, ref = _bounds(log.task_id, log.seed)
    span = max(ref - floor, 1e-6)
    score = min(1.0, max(0.0, 0.5 * (ret - floor) / span))
    return Grade(log.task_id, log.seed, score, ret, floor, ref)
