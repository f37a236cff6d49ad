"""Tool-call grammars: an environment's tool schemas as one typed object, for the speculation layer.

Invariant: the grammar is derived from the same tool schemas the model is prompted with, so a call the
grammar accepts is a call the environment parses (the format and its parser are ``core.toolcall``:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).

``ToolGrammar`` is a plain typed object: ``tools`` is a tuple of (tool name, JSON schema of
its arguments); ``call_schema()`` is the JSON schema of the whole call object (one branch
per tool, ``name`` pinned with ``const``), which a JSON-schema grammar compiler (xgrammar,
llguidance) turns into a matcher; ``begin``/``end`` are the literal tags around it.
``envhub.grammar_for`` builds one from an environment's ``ToolSpec`` list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.toolcall import TOOL_CALL_BEGIN, TOOL_CALL_END

JSON = Any  # a JSON value (str, int, float, bool, None, list, dict)


@dataclass(frozen=True, slots=True)
class ToolGrammar:
    """The tool-call grammar of one environment."""

    env_name: str
    tools: tuple[tuple[str, Mapping[str, JSON]], ...]
    begin: str = TOOL_CALL_BEGIN
    end: str = TOOL_CALL_END

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tools)

    def call_schema(self) -> dict[str, JSON]:
        """JSON schema of one call object ``{"name": <tool>, "arguments": {...}}``."""
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": dict(schema)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in self.tools
        ]
        if len(branches) == 1:
            return branches[0]
        return {"anyOf": branches}

    def to_json(self) -> str:
        return json.dumps(
            {"env": self.env_name, "begin": self.begin, "end": self.end, "schema": self.call_schema()}, sort_keys=True
        )
