"""``LLMServeEnvironment``: openenv-core's ``Environment`` over one simulated episode.

One instance per WebSocket session (``SUPPORTS_CONCURRENT_SESSIONS``): instances share nothing
but the ``EpisodeArchive`` where finished episodes' logs wait for ``POST /grader``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from llmserve.episode import Episode
from llmserve.models import EpisodeLog, ServeAction, ServeObservation, ServeState, action_fields
from llmserve.tasks import get_task

DEFAULT_TASK = "static_workload"


class EpisodeFinishedError(RuntimeError):
    """A step after the episode's last window."""


class EpisodeNotStartedError(RuntimeError):
    """A step before any reset."""


def mode() -> str:
    """``LLMSERVE_MODE``: ``sim`` (default, the calibrated simulator) or ``real`` (through a bridge)."""
    value = os.environ.get("LLMSERVE_MODE", "sim")
    if value not in ("sim", "real"):
        raise ValueError(f"LLMSERVE_MODE must be 'sim' or 'real', not {value!r}")
    return value


class EpisodeArchive:
    """The last ``capacity`` finished episodes' logs, by episode id (thread-safe)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._logs: OrderedDict[str, EpisodeLog] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, episode_id: str, log: EpisodeLog) -> None:
        with self._lock:
            self._logs[episode_id] = log
            self._logs.move_to_end(episode_id)
            while len(self._logs) > self._capacity:
                self._logs.popitem(last=False)

    def get(self, episode_id: str | None) -> EpisodeLog | None:
        with self._lock:
            if episode_id is None:
                return next(reversed(self._logs.values()), None)
            return self._logs.get(episode_id)


class LLMServeEnvironment(Environment[ServeAction, ServeObservation, ServeState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, archive: EpisodeArchive | None = None) -> None:
        super().__init__()
        self._archive = archive or EpisodeArchive()
        self._episode: Episode | None = None
        self._state = ServeState()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, task_id: str = DEFAULT_TASK, **kwargs: Any
    ) -> ServeObservation:
        spec = get_task(task_id)  # UnknownTaskError lists the tasks
        seed = 0 if seed is None else seed
        if self._episode is not None:
            self._episode.close()
        self._episode = Episode(spec, seed, mode())
        self._state = ServeState(
            episode_id=episode_id or uuid.uuid4().hex,
            step_count=0,
            task_id=task_id,
            seed=seed,
            episode_length=spec.episode_length,
            episode_log=EpisodeLog(task_id=task_id, seed=seed),
        )
        return self._episode.initial_observation()

    def step(self, action: ServeAction, timeout_s: float | None = None, **kwargs: Any) -> ServeObservation:
        ep = self._episode
        if ep is None:
            raise EpisodeNotStartedError("no episode: send reset (with task_id and seed) first")
        if ep.done:
            raise EpisodeFinishedError(
                f"episode {self._state.episode_id} of {ep.spec.task_id!r} is finished "
                f"({ep.spec.episode_length} steps); reset to start another"
            )
        obs = ep.step(action)
        log = self._state.episode_log
        assert log is not None
        log.actions.append(action_fields(action))
        log.rewards.append(float(obs.reward or 0.0))
        self._state.step_count = ep.step_index
        self._state.total_reward = ep.total_reward
        self._state.done = ep.done
        if ep.done and self._state.episode_id and ep.mode == "sim":  # a measured episode does not replay
            self._archive.put(self._state.episode_id, log.model_copy(deep=True))
        return obs

    def close(self) -> None:
        if self._episode is not None:
            self._episode.close()

    @property
    def state(self) -> ServeState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="llmserve",
            description=(
                "LLMServeEnv: pick an LLM serving configuration (batch cap, KV budget, speculation depth, "
                "quantization, prefill/decode split, priority routing) each window of a simulated GPU "
                "serving changing traffic; rewarded for SLO-meeting throughput, memory pressure and cost."
            ),
            version="0.1.0",
            documentation_url="docs/llmserve.md",
        )
