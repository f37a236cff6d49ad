"""Plain typed objects of the env hub (no protobuf, no transport).

Invariants:
- A tool is described by a JSON schema (``ToolSpec.parameters``, a JSON-compatible mapping);
  that schema is the single source for prompts, validation and the speculation grammar.
- Observations are chat messages (``core.types.Message``; role ``tool`` for tool results),
  so the bridge renders them with the engine's own chat template and appends them as env
  tokens (loss mask 0).
- Rewards are floats; ready environments grade in [0, 1].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.toolcall import ToolCall  # the tool-call format's own type; re-exported here
from core.types import Message

# JSON values as they come out of ``json.loads``.
JSON = Any


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool: a name, a description for the model and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, JSON]

    def to_openai(self) -> dict[str, JSON]:
        """The OpenAI/HF ``tools=[...]`` entry (what chat templates render)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_openai(), sort_keys=True)


def string_tool(name: str, description: str, **props: str) -> ToolSpec:
    """A tool whose arguments are all required strings (``props``: argument name -> description)."""
    return ToolSpec(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
            "required": list(props),
            "additionalProperties": False,
        },
    )


@dataclass(frozen=True, slots=True)
class FinalAnswer:
    """The model's final answer; stepping with it ends the episode and grades it."""

    text: str


Action = ToolCall | FinalAnswer


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool returned (or the error it refused with), as shown to the model."""

    name: str
    content: str
    is_error: bool = False
    error_kind: str = ""
    elapsed_s: float = 0.0
    images: tuple[bytes, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.is_error

    def as_message(self) -> Message:
        return Message(role="tool", content=self.content, name=self.name)


@dataclass(frozen=True, slots=True)
class ToolTraceEntry:
    """One executed tool call, kept for reward shaping and the episode state."""

    name: str
    ok: bool
    elapsed_s: float
    error_kind: str = ""


@dataclass(frozen=True, slots=True)
class ResetResult:
    """The opening of an episode: messages for the prompt and the tools on offer."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...]
    task_id: str


@dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one action."""

    observation: tuple[Message, ...]
    reward: float
    done: bool
    tool_result: ToolResult | None = None
    reward_terms: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class EnvState:
    """A snapshot of an episode (OpenEnv ``/state``)."""

    env_name: str
    episode_id: str
    task_id: str
    step_count: int
    done: bool
    reward: float
    trace: tuple[ToolTraceEntry, ...] = field(default=())
