"""OpenEnv for the Env Hub, on openenv-core: serve a hub environment, and use a remote OpenEnv one.

Serving: ``create_app(factory)`` is openenv-core's ``create_app`` over ``HubEnvironment``, which wraps one hub
environment per session (``factory()`` makes it). So a hub env gets everything openenv-core's server gives —
``/ws`` stateful sessions, ``/reset``/``/step``/``/state`` over HTTP (stateless: one fresh environment per
request, as openenv-core defines them), ``/schema``, ``/metadata``, ``/health``, ``/mcp`` — and passes
``openenv validate --url``. Wire types:

- ``HubAction``: ``{"tool": name, "arguments": {...}}`` or ``{"answer": text}`` (exactly one of the two);
- ``HubObservation``: ``messages`` (``{"role", "content", "name"}``), ``tools`` (OpenAI function entries, on
  reset), ``task_id``, ``is_error`` (the tool refused), plus openenv-core's ``reward``/``done``/``metadata``;
- ``HubState``: ``episode_id``, ``step_count``, ``env_name``, ``task_id``, ``done``, ``reward``.

Errors keep the hub's vocabulary, ``{"error": message, "code": gRPC status name}``, with the HTTP status of the
error's class (the one map of ``core.errors``): an unknown task or bad argument -> 400, a step before reset or
after the end -> 409; a malformed action -> openenv-core's 422.

Using a remote one: ``OpenEnvClient(url)`` is a hub ``Environment`` over openenv-core's ``EnvClient`` (``/ws``),
so the tool loop can drive any OpenEnv server (the URL is the operator's, not the model's: no SSRF guard).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from openenv.core.client_types import StepResult as OpenEnvStep
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app as openenv_create_app
from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from openenv.core.env_server.types import Action as OpenEnvAction
from openenv.core.env_server.types import Observation as OpenEnvObservation
from openenv.core.env_server.types import State as OpenEnvState
from pydantic import Field

from core.errors import FailedPrecondition, InvalidArgument, PrimeRLError, ToolError, grpc_code_name
from core.errors_http import json_error
from core.types import Message
from envhub.base import Environment
from envhub.openenv_guard import ActionTypeGuard
from envhub.types import JSON, Action, EnvState, FinalAnswer, ResetResult, StepResult, ToolCall, ToolSpec

T = TypeVar("T")
_CLOSING: set[asyncio.Task[None]] = set()  # closes scheduled on the server loop (held until done)
MAX_SESSIONS = 64


class HubAction(OpenEnvAction):
    """A tool call or the final answer."""

    tool: str | None = Field(default=None, description="name of the tool to call (one of the reset's tools)")
    arguments: dict[str, Any] = Field(default_factory=dict, description="the tool's arguments (its JSON schema)")
    answer: str | None = Field(default=None, description="the final answer; ends the episode")

    def to_hub(self) -> Action:
        # Checked here, not by a pydantic validator: openenv-core cannot serialise a validator's ValueError (a 500).
        if (self.tool is None) == (self.answer is None):
            raise InvalidArgument('an action is {"tool": name, "arguments": {...}} or {"answer": text}, exactly one')
        return FinalAnswer(self.answer) if self.answer is not None else ToolCall(str(self.tool), self.arguments)

    @classmethod
    def of(cls, action: Action) -> HubAction:
        if isinstance(action, FinalAnswer):
            return cls(answer=action.text)
        return cls(tool=action.name, arguments=dict(action.arguments))


class HubObservation(OpenEnvObservation):
    """Chat messages for the model (the tools and the task on reset)."""

    messages: list[dict[str, str]] = Field(default_factory=list, description="role, content, name")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="OpenAI function entries (on reset)")
    task_id: str = Field(default="", description="the task of this episode")
    is_error: bool = Field(default=False, description="the tool refused or failed")


class HubState(OpenEnvState):
    env_name: str = ""
    task_id: str = ""
    done: bool = False
    reward: float = 0.0


def action_schema(tools: tuple[ToolSpec, ...]) -> dict[str, JSON]:
    """The JSON schema of the actions one environment accepts (a call of each tool, or the answer)."""
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


def _messages(items: list[dict[str, str]]) -> tuple[Message, ...]:
    return tuple(Message(role=m["role"], content=m["content"], name=m.get("name", "")) for m in items)


def _coded(e: PrimeRLError) -> PrimeRLError:
    """The same error with its status name in the message: openenv-core's ``/ws`` sends the message only."""
    out = PrimeRLError(f"{e.code}: {e}")
    out.code, out.http_status = e.code, e.http_status
    return out


async def _hub_call(op: Awaitable[T]) -> T:
    try:
        return await op
    except PrimeRLError as e:
        raise _coded(e) from e


class HubEnvironment(OpenEnvEnvironment[HubAction, HubObservation, HubState]):
    """One hub environment as an openenv-core environment (one instance per session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: Environment) -> None:
        super().__init__()
        self.env = env

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None, **_: Any
    ) -> HubObservation:
        res = await _hub_call(self.env.reset(task_id=task_id, seed=seed))
        tools = [t.to_openai() for t in res.tools]
        return HubObservation(messages=_messages_json(res.messages), tools=tools, task_id=res.task_id)

    async def step_async(self, action: HubAction, timeout_s: float | None = None, **_: Any) -> HubObservation:
        res = await _hub_call(self._step(action))
        is_error = res.tool_result is not None and res.tool_result.is_error
        return HubObservation(
            messages=_messages_json(res.observation), is_error=is_error, reward=res.reward, done=res.done
        )

    async def _step(self, action: HubAction) -> StepResult:
        return await self.env.step(action.to_hub())

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> HubObservation:
        return asyncio.run(self.reset_async(seed, episode_id, **kwargs))

    def step(self, action: HubAction, timeout_s: float | None = None, **kwargs: Any) -> HubObservation:
        return asyncio.run(self.step_async(action, timeout_s, **kwargs))

    @property
    def state(self) -> HubState:
        s = self.env.state()
        return HubState(
            episode_id=s.episode_id, step_count=s.step_count, env_name=s.env_name, task_id=s.task_id,
            done=s.done, reward=s.reward,
        )  # fmt: skip

    def close(self) -> None:
        """openenv-core closes from its executor (no loop: run it) or on the server's loop (schedule it there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.env.close())
            return
        task = loop.create_task(self.env.close(), name="envhub-openenv-close")
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


def create_app(factory: Callable[[], Environment], name: str = "envhub") -> FastAPI:
    """openenv-core's app serving ``factory()``'s environment, one instance per session."""
    app = openenv_create_app(
        lambda: HubEnvironment(factory()), HubAction, HubObservation, env_name=name, max_concurrent_envs=MAX_SESSIONS
    )

    async def hub_error(_: Request, exc: Exception) -> Response:
        return json_error(exc, {"error": str(exc), "code": grpc_code_name(exc)})

    app.add_exception_handler(PrimeRLError, hub_error)
    app.add_middleware(ActionTypeGuard)
    return app


class _Wire(EnvClient[HubAction, HubObservation, HubState]):
    def _step_payload(self, action: HubAction) -> dict[str, Any]:
        return action.model_dump(exclude_none=True)

    def _parse_result(self, payload: dict[str, Any]) -> OpenEnvStep[HubObservation]:
        obs = HubObservation(**payload.get("observation", {}), reward=payload.get("reward"), done=payload["done"])
        return OpenEnvStep(observation=obs, reward=payload.get("reward"), done=bool(payload.get("done")))

    def _parse_state(self, payload: dict[str, Any]) -> HubState:
        return HubState(**payload)


class OpenEnvClient:
    """A hub ``Environment`` backed by a remote OpenEnv server, over openenv-core's client (``/ws``)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, name: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or f"openenv:{self.base_url}"
        self._wire = _Wire(self.base_url, message_timeout_s=timeout_s)
        self._tools: tuple[ToolSpec, ...] = ()
        self._last = EnvState(self.name, "", "", 0, False, 0.0)

    async def _call(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            return await op()
        except (OSError, ConnectionError, TimeoutError) as e:
            raise ToolError(f"OpenEnv server {self.base_url} unreachable: {e}", kind="unavailable") from e
        except RuntimeError as e:  # openenv-core's client raises the server's error message as RuntimeError
            text = str(e)
            if "FAILED_PRECONDITION:" in text:
                raise FailedPrecondition(f"OpenEnv {what}: {text}") from e
            if "INVALID_ARGUMENT:" in text or "VALIDATION_ERROR" in text:
                raise InvalidArgument(f"OpenEnv {what}: {text}") from e
            raise ToolError(f"OpenEnv {what} failed: {text}", kind="unavailable") from e

    def tools(self) -> tuple[ToolSpec, ...]:
        return self._tools

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult:
        kwargs: dict[str, Any] = {} if task_id is None else {"task_id": task_id}
        result = await self._call("reset", lambda: self._wire.reset(seed=seed, **kwargs))
        obs: HubObservation = result.observation
        self._tools = tuple(
            ToolSpec(f["function"]["name"], f["function"].get("description", ""), f["function"].get("parameters", {}))
            for f in obs.tools
        )
        await self.refresh_state()
        return ResetResult(_messages(obs.messages), self._tools, obs.task_id)

    async def step(self, action: Action) -> StepResult:
        result = await self._call("step", lambda: self._wire.step(HubAction.of(action)))
        await self.refresh_state()
        reward = result.reward
        return StepResult(_messages(result.observation.messages), float(reward or 0.0), bool(result.done))

    async def refresh_state(self) -> EnvState:
        s: HubState = await self._call("state", self._wire.state)
        self._last = EnvState(s.env_name or self.name, s.episode_id or "", s.task_id, s.step_count, s.done, s.reward)
        return self._last

    def state(self) -> EnvState:
        """The state as of the last reset/step (``refresh_state`` asks the server)."""
        return self._last

    async def close(self) -> None:
        await self._wire.close()


def main() -> None:
    """``python -m envhub.openenv ENV_NAME [--host H] [--port P]``: serve a hub env over openenv-core."""
    import argparse

    import uvicorn

    from envhub.registry import make_env, names

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("env", choices=names())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(lambda: make_env(args.env), args.env), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
