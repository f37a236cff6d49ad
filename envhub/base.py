"""The environment protocol, and a base class for tool environments with graded tasks.

Invariants:
- ``reset`` starts a fresh episode; ``step`` takes a ``ToolCall`` (executed, its result
  returned as a ``tool`` message) or a ``FinalAnswer`` (graded; the episode is done);
  ``state`` is a snapshot that never blocks.
- A tool failure is an observation, never an exception: connectors raise ``ToolError``,
  ``ToolEnvironment.step`` turns it into an error message for the model and records it
  in the trace (the tool-trace reward term sees it).
- Stepping a finished episode raises ``FailedPrecondition``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from core.errors import FailedPrecondition, InvalidArgument, ToolError
from core.types import Message
from envhub.graders import EXACT, Answer, Grader
from envhub.rewards import RewardContext, Shaping, default_shaping, extract_answer
from envhub.types import (
    JSON,
    Action,
    EnvState,
    FinalAnswer,
    ResetResult,
    StepResult,
    ToolCall,
    ToolResult,
    ToolSpec,
    ToolTraceEntry,
)


@runtime_checkable
class Environment(Protocol):
    """What the hub, the tool loop and the OpenEnv facade drive."""

    name: str

    def tools(self) -> tuple[ToolSpec, ...]: ...

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult: ...

    async def step(self, action: Action) -> StepResult: ...

    def state(self) -> EnvState: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Task:
    """One task: the question shown to the model and the reference its grader checks against."""

    task_id: str
    question: str
    reference: str


ToolFn = Callable[[Mapping[str, JSON]], Awaitable[ToolResult]]


def check_arguments(spec: ToolSpec, arguments: Mapping[str, JSON]) -> None:
    """Check required keys and simple JSON types (enough for the hub's own flat schemas)."""
    props = spec.parameters.get("properties", {})
    for key in spec.parameters.get("required", []):
        if key not in arguments:
            raise ToolError(f"{spec.name}: missing required argument {key!r}", kind="invalid")
    types: dict[str, type | tuple[type, ...]] = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array": list,
    }
    for key, value in arguments.items():
        if key not in props:
            if spec.parameters.get("additionalProperties", True) is False:
                raise ToolError(f"{spec.name}: unknown argument {key!r}", kind="invalid")
            continue
        want = props[key].get("type")
        if isinstance(want, str) and want in types and not isinstance(value, types[want]):
            raise ToolError(f"{spec.name}: argument {key!r} must be a {want}", kind="invalid")


class ToolEnvironment:
    """Bookkeeping shared by the ready environments: tasks, tools, trace, grading, shaping.

    Subclasses set ``name``, ``system_prompt``, ``tasks`` and register tools with
    ``add_tool``; the final answer is graded by ``grader`` (an answer grader, default ``exact``;
    or override ``grade(task, answer) -> float in [0, 1]``) and shaped by ``rubric``. Code its tools
    run goes through the sandbox under ``sandbox_policy`` (a shipped policy's name, ``sandbox.policies``).
    """

    name = "tool-env"
    system_prompt = ""
    grader: Grader[Answer] = EXACT
    sandbox_policy = "default"

    def __init__(self, tasks: tuple[Task, ...], rubric: Shaping | None = None) -> None:
        if not tasks:
            raise InvalidArgument(f"environment {self.name!r} needs at least one task")
        self.tasks = tasks
        self.rubric = rubric or default_shaping()
        self._tools: dict[str, tuple[ToolSpec, ToolFn]] = {}
        self._task = tasks[0]
        self._episode_id = ""
        self._steps = 0
        self._done = False
        self._reward = 0.0
        self._trace: list[ToolTraceEntry] = []

    def add_tool(self, spec: ToolSpec, fn: ToolFn) -> None:
        self._tools[spec.name] = (spec, fn)

    def tools(self) -> tuple[ToolSpec, ...]:
        return tuple(spec for spec, _ in self._tools.values())

    def grade(self, task: Task, answer: str) -> float:
        return self.grader(Answer(answer, task.reference))

    def task_by_id(self, task_id: str | None, seed: int | None) -> Task:
        if task_id is not None:
            for t in self.tasks:
                if t.task_id == task_id:
                    return t
            raise InvalidArgument(f"environment {self.name!r} has no task {task_id!r}")
        return self.tasks[(seed or 0) % len(self.tasks)]

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult:
        self._task = self.task_by_id(task_id, seed)
        self._episode_id = uuid.uuid4().hex
        self._steps = 0
        self._done = False
        self._reward = 0.0
        self._trace = []
        messages = []
        if self.system_prompt:
            messages.append(Message(role="system", content=self.system_prompt))
        messages.append(Message(role="user", content=self._task.question))
        return ResetResult(messages=tuple(messages), tools=self.tools(), task_id=self._task.task_id)

    async def step(self, action: Action) -> StepResult:
        if self._done:
            raise FailedPrecondition(f"episode {self._episode_id} of {self.name!r} is done; call reset")
        if not self._episode_id:
            raise FailedPrecondition(f"{self.name!r}: call reset before step")
        if isinstance(action, FinalAnswer):
            return self.finish(action.text)
        result = await self.call_tool(action)
        self._steps += 1
        self._trace.append(ToolTraceEntry(result.name, not result.is_error, result.elapsed_s, result.error_kind))
        return StepResult(observation=(result.as_message(),), reward=0.0, done=False, tool_result=result)

    async def call_tool(self, call: ToolCall) -> ToolResult:
        entry = self._tools.get(call.name)
        t0 = time.monotonic()
        if entry is None:
            known = ", ".join(sorted(self._tools))
            return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: {known}", True, "invalid")
        spec, fn = entry
        try:
            check_arguments(spec, call.arguments)
            result = await fn(call.arguments)
        except ToolError as e:
            return ToolResult(call.name, f"error ({e.kind}): {e.message}", True, e.kind, time.monotonic() - t0)
        if not result.elapsed_s:
            result = ToolResult(
                result.name, result.content, result.is_error, result.error_kind, time.monotonic() - t0, result.images
            )
        return result

    def finish(self, text: str, truncated: bool = False) -> StepResult:
        """Grade ``text`` as the final answer and close the episode."""
        answer, format_ok = extract_answer(text)
        success = 0.0 if truncated else self.grade(self._task, answer)
        ctx = RewardContext(
            success=success,
            format_ok=format_ok,
            steps=self._steps,
            tool_seconds=sum(t.elapsed_s for t in self._trace),
            trace=tuple(self._trace),
            truncated=truncated,
        )
        breakdown = self.rubric.score(ctx)
        self._done = True
        self._reward = breakdown.total
        return StepResult(observation=(), reward=breakdown.total, done=True, reward_terms=breakdown.terms)

    def state(self) -> EnvState:
        return EnvState(
            env_name=self.name,
            episode_id=self._episode_id,
            task_id=self._task.task_id,
            step_count=self._steps,
            done=self._done,
            reward=self._reward,
            trace=tuple(self._trace),
        )

    async def close(self) -> None:
        return None
