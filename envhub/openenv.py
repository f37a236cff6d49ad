"""OpenEnv compatibility: serve a hub environment over HTTP, and use a remote one.

Wire format (OpenEnv's HTTP environment server):

- ``POST /reset`` ``{"seed": int?, "task_id": str?}`` ->
  ``{"observation": {"messages": [...], "tools": [...], "task_id": str}, "reward": null, "done": false}``
- ``POST /step`` ``{"action": {"tool": name, "arguments": {...}} | {"answer": str}}`` ->
  ``{"observation": {"messages": [...]}, "reward": float, "done": bool}``
- ``GET /state`` -> ``{"episode_id", "step_count", "env_name", "task_id", "done", "reward"}``
- ``GET /health`` -> ``{"status": "healthy"}``
- ``GET /schema`` -> JSON schemas of ``action``, ``observation`` and ``state``.

Messages are ``{"role", "content", "name"}``; tools are OpenAI-style function entries.
Errors: 400 for bad input (``InvalidArgument``), 409 for a step out of order
(``FailedPrecondition``), with ``{"error": message, "code": status name}``.

Invariant: one server serves one environment instance (OpenEnv's one-episode-per-server
model); requests are serialised by a lock, so state is never read mid-step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines.errors import FailedPrecondition, InvalidArgument, PrimeRLError, ToolError
from engines.types import Message
from envhub.base import Environment
from envhub.types import JSON, Action, EnvState, FinalAnswer, ResetResult, StepResult, ToolCall, ToolSpec

_MESSAGE_SCHEMA = {
    "type": "object",
    "properties": {"role": {"type": "string"}, "content": {"type": "string"}, "name": {"type": "string"}},
    "required": ["role", "content"],
}


def action_schema(tools: tuple[ToolSpec, ...]) -> dict[str, JSON]:
    calls = [
        {
            "type": "object",
            "properties": {"tool": {"const": t.name}, "arguments": dict(t.parameters)},
            "required": ["tool", "arguments"],
        }
        for t in tools
    ]
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    return {"anyOf": [*calls, answer]}


def _messages_json(messages: tuple[Message, ...]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content, "name": m.name} for m in messages]


def _state_json(state: EnvState) -> dict[str, JSON]:
    return {
        "episode_id": state.episode_id,
        "step_count": state.step_count,
        "env_name": state.env_name,
        "task_id": state.task_id,
        "done": state.done,
        "reward": state.reward,
    }


def parse_action(body: Mapping[str, JSON]) -> Action:
    action = body.get("action")
    if not isinstance(action, dict):
        raise InvalidArgument('body must be {"action": {...}}')
    if isinstance(action.get("answer"), str):
        return FinalAnswer(action["answer"])
    name, args = action.get("tool"), action.get("arguments", {})
    if not isinstance(name, str) or not isinstance(args, dict):
        raise InvalidArgument('action must be {"tool": name, "arguments": {...}} or {"answer": text}')
    return ToolCall(name=name, arguments=args)


_STATE_SCHEMA = {
    "type": "object",
    "properties": {
        "episode_id": {"type": "string"},
        "step_count": {"type": "integer"},
        "env_name": {"type": "string"},
        "task_id": {"type": "string"},
        "done": {"type": "boolean"},
        "reward": {"type": "number"},
    },
}
_OBSERVATION_SCHEMA = {
    "type": "object",
    "properties": {"messages": {"type": "array", "items": _MESSAGE_SCHEMA}, "tools": {"type": "array"}},
    "required": ["messages"],
}


class _Session:
    """The served environment instance: requests are serialised by one lock (one episode per server)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.lock = asyncio.Lock()

    async def reset(self, body: Mapping[str, JSON]) -> dict[str, JSON]:
        seed, task_id = body.get("seed"), body.get("task_id")
        if seed is not None and not isinstance(seed, int):
            raise InvalidArgument("seed must be an integer")
        if task_id is not None and not isinstance(task_id, str):
            raise InvalidArgument("task_id must be a string")
        async with self.lock:
            res = await self.env.reset(task_id=task_id, seed=seed)
        obs = {
            "messages": _messages_json(res.messages),
            "tools": [t.to_openai() for t in res.tools],
            "task_id": res.task_id,
        }
        return {"observation": obs, "reward": None, "done": False}

    async def step(self, body: Mapping[str, JSON]) -> dict[str, JSON]:
        action = parse_action(body)
        async with self.lock:
            res = await self.env.step(action)
        obs: dict[str, JSON] = {"messages": _messages_json(res.observation)}
        if res.tool_result is not None:
            obs["is_error"] = res.tool_result.is_error
        return {"observation": obs, "reward": res.reward, "done": res.done}

    def state(self) -> dict[str, JSON]:
        return _state_json(self.env.state())

    def schema(self) -> dict[str, JSON]:
        return {"action": action_schema(self.env.tools()), "observation": _OBSERVATION_SCHEMA, "state": _STATE_SCHEMA}


async def _body_of(request: Request) -> dict[str, JSON]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8/16/32
        raise InvalidArgument(f"body is not JSON: {getattr(e, 'msg', e)}") from e
    if not isinstance(value, dict):
        raise InvalidArgument("body must be a JSON object")
    return value


def _post(path: str, handler: Callable[[Mapping[str, JSON]], Awaitable[dict[str, JSON]]]) -> Route:
    """A POST endpoint: JSON body in, JSON out; 400 for bad input, 409 for a call out of order."""

    async def endpoint(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await handler(await _body_of(request)))
        except PrimeRLError as e:
            status = 409 if isinstance(e, FailedPrecondition) else 400 if isinstance(e, InvalidArgument) else 500
            return JSONResponse({"error": e.message, "code": e.code}, status_code=status)

    return Route(path, endpoint, methods=["POST"])


def _get(path: str, view: Callable[[], dict[str, JSON]]) -> Route:
    async def endpoint(_: Request) -> JSONResponse:
        return JSONResponse(view())

    return Route(path, endpoint, methods=["GET"])


def create_app(env: Environment) -> Starlette:
    """An ASGI app serving ``env`` with the OpenEnv HTTP API."""
    session = _Session(env)
    return Starlette(
        routes=[
            _post("/reset", session.reset),
            _post("/step", session.step),
            _get("/state", session.state),
            _get("/health", lambda: {"status": "healthy"}),
            _get("/schema", session.schema),
        ]
    )


class OpenEnvClient:
    """An ``Environment`` backed by a remote OpenEnv HTTP server.

    The URL is configured by the operator (not chosen by a model), so it is not SSRF-guarded.
    """

    def __init__(self, base_url: str, timeout_s: float = 30.0, name: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or f"openenv:{self.base_url}"
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, trust_env=False)
        self._tools: tuple[ToolSpec, ...] = ()
        self._last = EnvState(self.name, "", "", 0, False, 0.0)

    async def _call(self, method: str, path: str, body: Mapping[str, JSON] | None = None) -> Any:
        try:
            resp = await self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise ToolError(f"OpenEnv server {self.base_url} unreachable: {e}", kind="unavailable") from e
        data = resp.json() if resp.content else {}
        if resp.status_code == 409:
            raise FailedPrecondition(str(data.get("error", resp.text)))
        if resp.status_code == 400:
            raise InvalidArgument(str(data.get("error", resp.text)))
        if resp.status_code >= 400:
            raise ToolError(f"OpenEnv {path} answered HTTP {resp.status_code}: {resp.text[:200]}", kind="unavailable")
        return data

    def tools(self) -> tuple[ToolSpec, ...]:
        return self._tools

    async def health(self) -> bool:
        data = await self._call("GET", "/health")
        return bool(data.get("status") == "healthy")

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult:
        body: dict[str, JSON] = {}
        if task_id is not None:
            body["task_id"] = task_id
        if seed is not None:
            body["seed"] = seed
        data = await self._call("POST", "/reset", body)
        obs = data.get("observation", {})
        self._tools = tuple(
            ToolSpec(f["function"]["name"], f["function"].get("description", ""), f["function"].get("parameters", {}))
            for f in obs.get("tools", [])
        )
        await self.refresh_state()
        return ResetResult(_messages(obs.get("messages", [])), self._tools, str(obs.get("task_id", "")))

    async def step(self, action: Action) -> StepResult:
        if isinstance(action, FinalAnswer):
            payload: dict[str, JSON] = {"answer": action.text}
        else:
            payload = {"tool": action.name, "arguments": dict(action.arguments)}
        data = await self._call("POST", "/step", {"action": payload})
        await self.refresh_state()
        reward = data.get("reward")
        return StepResult(
            observation=_messages(data.get("observation", {}).get("messages", [])),
            reward=float(reward) if reward is not None else 0.0,
            done=bool(data.get("done", False)),
        )

    async def refresh_state(self) -> EnvState:
        d = await self._call("GET", "/state")
        self._last = EnvState(
            env_name=str(d.get("env_name", self.name)),
            episode_id=str(d.get("episode_id", "")),
            task_id=str(d.get("task_id", "")),
            step_count=int(d.get("step_count", 0)),
            done=bool(d.get("done", False)),
            reward=float(d.get("reward") or 0.0),
        )
        return self._last

    def state(self) -> EnvState:
        """The state as of the last reset/step (``refresh_state`` asks the server)."""
        return self._last

    async def close(self) -> None:
        await self._client.aclose()


def _messages(items: list[Mapping[str, str]]) -> tuple[Message, ...]:
    return tuple(Message(role=m["role"], content=m["content"], name=m.get("name", "")) for m in items)


def main() -> None:
    """``python -m envhub.openenv ENV_NAME [--host H] [--port P]``: serve a hub env over OpenEnv HTTP."""
    import argparse

    import uvicorn

    from envhub.registry import make_env, names

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("env", choices=names())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(make_env(args.env)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
