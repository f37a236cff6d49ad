"""The RL-primitives environments, on the Env Hub's one ``envhub.Environment`` protocol.

``BaseEnvironment`` implements ``envhub.Environment`` (``name``, ``tools``, ``reset``, ``step``, ``state``,
``close``), so the hub's ``ToolLoop`` and OpenEnv facade drive these exactly as they drive the hub's own
environments; there is no second hierarchy. A subclass says what a turn does (``transition``) and what the
finished episode is worth (``score``); ``step`` takes the model's turn as ``FinalAnswer(text)`` (the text of
one assistant turn: the episode ends when ``transition`` returns no observation) or a ``ToolCall`` (run by
``call_tool``; a tool result is an observation, never the end). ``is_terminal`` and ``State`` are the
document's names for the episode's progress.

One instance is one episode at a time; ``fork()`` gives a fresh instance with the same configuration (the
rollout manager forks one per group member).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import FailedPrecondition
from core.types import Message
from envhub import EnvState, FinalAnswer, ResetResult, StepResult, ToolCall, ToolResult, ToolSpec


@dataclass
class State:
    """An episode so far: the conversation, the model's turns, and where it stands."""

    messages: list[Message]
    prompt: Any = None  # the task (a prompt string, a problem object)
    turns: list[str] = field(default_factory=list)  # the model's turn texts
    tool_results: list[ToolResult] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    episode_id: str = ""
    seed: int = 0


class BaseEnvironment:
    """``envhub.Environment`` with the RL-primitives hooks: ``initial_messages``, ``transition``, ``score``."""

    name = "base"
    max_turns = 1
    system_prompt = ""
    tool_loop = False  # True: the rollout manager runs turns through envhub's ToolLoop (tool calls -> call_tool)

    def __init__(self, prompts: Sequence[Any] = ()) -> None:
        self.prompts = list(prompts)
        self._state: State | None = None

    # -- hooks -----------------------------------------------------------------------------------

    def sample_prompt(self, seed: int) -> Any:
        """The task for ``seed`` (default: ``prompts[seed % len]``)."""
        if not self.prompts:
            raise FailedPrecondition(f"environment {self.name!r} has no prompts")
        return self.prompts[seed % len(self.prompts)]

    def initial_messages(self, prompt: Any) -> list[Message]:
        msgs = [Message("system", self.system_prompt)] if self.system_prompt else []
        return [*msgs, Message("user", str(prompt))]

    def transition(self, state: State, text: str) -> list[Message] | None:
        """The observation after the model's turn ``text``, or None when the episode is over."""
        return None

    def score(self, state: State) -> float:
        """The finished episode's reward."""
        return 0.0

    async def call_tool(self, call: ToolCall) -> ToolResult:
        known = ", ".join(t.name for t in self.tools()) or "none"
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: {known}", True, "invalid")

    def tools(self) -> tuple[ToolSpec, ...]:
        return ()

    def prompt_tool_schemas(self) -> list[str]:
        """The tool schemas the chat template renders into the prompt (JSON strings; default: ``tools()``)."""
        return [t.to_json() for t in self.tools()]

    # -- envhub.Environment ----------------------------------------------------------------------

    def fork(self) -> BaseEnvironment:
        twin = copy.copy(self)
        twin._state = None
        return twin

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult:
        s = int(task_id) if task_id is not None and task_id.isdigit() else (seed or 0)
        prompt = self.sample_prompt(s)
        self._state = State(self.initial_messages(prompt), prompt, episode_id=uuid.uuid4().hex, seed=s)
        return ResetResult(tuple(self._state.messages), self.tools(), str(s))

    @property
    def current(self) -> State:
        if self._state is None:
            raise FailedPrecondition(f"{self.name!r}: call reset before step")
        return self._state

    async def step(self, action: ToolCall | FinalAnswer) -> StepResult:
        st = self.current
        if st.done:
            raise FailedPrecondition(f"episode {st.episode_id} of {self.name!r} is done; call reset")
        if isinstance(action, ToolCall):
            result = await self.call_tool(action)
            st.tool_results.append(result)
            return StepResult((result.as_message(),), 0.0, False, tool_result=result)
        st.turns.append(action.text)
        st.messages.append(Message("assistant", action.text))
        observation = self.transition(st, action.text) if len(st.turns) < self.max_turns else None
        if observation is None:
            st.done = True
            st.reward = float(self.score(st))
            return StepResult((), st.reward, True)
        st.messages.extend(observation)
        return StepResult(tuple(observation), 0.0, False)

    def is_terminal(self) -> bool:
        return self._state is not None and self._state.done

    def state(self) -> EnvState:
        st = self.current
        return EnvState(self.name, st.episode_id, str(st.seed), len(st.turns), st.done, st.reward)

    async def close(self) -> None:
        return None


RewardFn = Callable[[Any, str], float]


class SimpleTextEnvironment(BaseEnvironment):
    """One prompt, one answer, ``reward_fn(prompt, answer) -> float``."""

    name = "simple-text"

    def __init__(self, prompts: Sequence[Any], reward_fn: RewardFn, system_prompt: str = "") -> None:
        super().__init__(prompts)
        self.reward_fn = reward_fn
        self.system_prompt = system_prompt

    def score(self, state: State) -> float:
        return float(self.reward_fn(state.prompt, state.turns[-1]))


class ConversationEnvironment(BaseEnvironment):
    """Multi-turn: ``respond_fn(state, text)`` gives the user's next message (None ends it) for up to
    ``max_turns`` model turns; ``reward_fn(state) -> float`` grades the whole conversation."""

    name = "conversation"

    def __init__(
        self,
        prompts: Sequence[Any],
        respond_fn: Callable[[State, str], str | None],
        reward_fn: Callable[[State], float],
        max_turns: int = 3,
        system_prompt: str = "",
    ) -> None:
        super().__init__(prompts)
        self.respond_fn = respond_fn
        self.reward_fn = reward_fn
        self.max_turns = max_turns
        self.system_prompt = system_prompt

    def transition(self, state: State, text: str) -> list[Message] | None:
        reply = self.respond_fn(state, text)
        return None if reply is None else [Message("user", reply)]

    def score(self, state: State) -> float:
        return float(self.reward_fn(state))


class SVRLEnvironment(BaseEnvironment):
    """Self-verification RL: the model may check candidate answers with a ``verify`` tool, at most
    ``tool_budget`` times, before its final answer; reward = ``answer_fn(prompt, answer)`` minus
    ``tool_cost`` per verification used (a verification past the budget is refused, as an error result)."""

    name = "svrl"
    tool_loop = True

    def __init__(
        self,
        prompts: Sequence[Any],
        answer_fn: RewardFn,
        tool_budget: int = 2,
        tool_cost: float = 0.05,
        system_prompt: str = "Check your answer with the verify tool if unsure, then give the final answer.",
    ) -> None:
        super().__init__(prompts)
        self.answer_fn = answer_fn
        self.tool_budget = tool_budget
        self.tool_cost = tool_cost
        self.system_prompt = system_prompt
        self.max_turns = tool_budget + 1

    def tools(self) -> tuple[ToolSpec, ...]:
        params: Mapping[str, Any] = {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "the candidate answer"}},
            "required": ["answer"],
            "additionalProperties": False,
        }
        return (ToolSpec("verify", "Check a candidate answer: replies 'correct' or 'incorrect'.", params),)

    async def call_tool(self, call: ToolCall) -> ToolResult:
        st = self.current
        if call.name != "verify":
            return await super().call_tool(call)
        used = int(st.info.get("verifications", 0))
        if used >= self.tool_budget:
            return ToolResult(
                "verify", f"error: the budget of {self.tool_budget} verifications is used up", True, "limit"
            )
        st.info["verifications"] = used + 1
        ok = self.answer_fn(st.prompt, str(call.arguments.get("answer", ""))) >= 1.0
        return ToolResult("verify", "correct" if ok else "incorrect")

    def score(self, state: State) -> float:
        used = int(state.info.get("verifications", 0))
        return float(self.answer_fn(state.prompt, state.turns[-1])) - self.tool_cost * used


__all__ = [
    "BaseEnvironment",
    "ConversationEnvironment",
    "RewardFn",
    "SVRLEnvironment",
    "SimpleTextEnvironment",
    "State",
]
