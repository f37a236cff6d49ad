"""``LLMServeEnv``: the typed client, an openenv-core ``EnvClient`` over ``/ws``.

env = LLMServeEnv.from_url("http://localhost:7860")
result = await env.reset(task_id="bursty_workload", seed=7)
result = await env.step(ServeAction(batch_cap=64))
state = await env.state()
grade = await env.grade()      # POST /grader for this session's finished episode
"""

from __future__ import annotations

from typing import Any

import httpx
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from llmserve.models import ServeAction, ServeObservation, ServeState, action_fields


class LLMServeEnv(EnvClient[ServeAction, ServeObservation, ServeState]):
    def __init__(self, base_url: str, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._http_url = base_url.rstrip("/").replace("ws://", "http://").replace("wss://", "https://")

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> LLMServeEnv:
        return cls(url, **kwargs)

    async def reset(
        self, task_id: str = "static_workload", seed: int = 0, **kwargs: Any
    ) -> StepResult[ServeObservation]:
        return await super().reset(task_id=task_id, seed=seed, **kwargs)

    def _step_payload(self, action: ServeAction) -> dict[str, Any]:
        return action_fields(action)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[ServeObservation]:
        obs = ServeObservation(**payload.get("observation", {}), reward=payload.get("reward"), done=payload["done"])
        return StepResult(observation=obs, reward=payload.get("reward"), done=bool(payload.get("done")))

    def _parse_state(self, payload: dict[str, Any]) -> ServeState:
        return ServeState(**payload)

    async def grade(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The grade of this session's current (finished) episode."""
        state = await self.state()
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            resp = await http.post(f"{self._http_url}/grader", json={"episode_id": state.episode_id})
        resp.raise_for_status()
        out: dict[str, Any] = resp.json()
        return out
