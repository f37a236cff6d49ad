"""A tool-call-heavy workload (a fixture, not shipped): speculation tests, ``bench/speculation.py``, ``bench/gate.py``.

Each episode is a chat with the env's tools in the system prompt (``engines.chat`` renders them
Hermes-style), one worked example of a tool-call block (``core.toolcall``) and its tool result, then a new user
question: the model's reply is usually a tool call whose arguments copy words from the question.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.grammar import ToolGrammar
from core.toolcall import format_call
from core.types import Message
from envhub.envs.code_math import PYTHON_TOOL
from envhub.envs.sql_qa import SQL_TOOL
from envhub.envs.web_lookup import FETCH_TOOL
from envhub.grammar import grammar_for
from envhub.types import ToolSpec

TOOLS: tuple[ToolSpec, ...] = (SQL_TOOL, FETCH_TOOL, PYTHON_TOOL)

_EXAMPLE: tuple[str, dict[str, Any], str] = (
    "How many employees work in the sales department?",
    {"name": "sql_query", "arguments": {"query": "SELECT COUNT(*) FROM employees WHERE department = 'sales'"}},
    "[[12]]",
)
QUESTIONS = (
    "How many customers live in Paris?",
    "What is the total amount of all orders placed in 2023?",
    "Fetch the page /products/blue-widget and tell me its price.",
    "Compute the sum of the squares of the numbers from 1 to 100 with Python.",
    "List the names of employees hired after 2020.",
    "Which product has the highest price in the products table?",
    "Open the page /about and summarise it.",
    "Use Python to compute 17 factorial.",
    "How many orders have the status 'shipped'?",
    "What is the average salary in the engineering department?",
)


@dataclass(frozen=True, slots=True)
class Episode:
    messages: tuple[Message, ...]
    tool_schemas: tuple[str, ...]


def tool_schemas(tools: tuple[ToolSpec, ...] = TOOLS) -> tuple[str, ...]:
    return tuple(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools)


def grammar(tools: tuple[ToolSpec, ...] = TOOLS) -> ToolGrammar:
    return grammar_for("workload", tools)


def episodes(n: int) -> list[Episode]:
    """``n`` episodes cycling through ``QUESTIONS`` (deterministic)."""
    q0, call, result = _EXAMPLE
    shot = (
        Message("user", q0),
        Message("assistant", format_call(call["name"], call["arguments"], sep="\n")),
        Message("tool", result),
        Message("assistant", "There are 12 employees in the sales department."),
    )
    schemas = tool_schemas()
    return [Episode((*shot, Message("user", QUESTIONS[i % len(QUESTIONS)])), schemas) for i in range(n)]
