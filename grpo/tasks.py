"""A small real task: arithmetic through a calculator tool call, then a final ``Answer: N``.

Episode (at most two sampled turns): the model sees a system prompt, one worked example (user question,
assistant ``<tool_call>``, ``tool`` result, ``Answer: N``) and the new question. Its first turn should call
``calculator`` with an ``expression``; the environment evaluates the first call (integers and ``+ - * ( )``
only, parsed with ``ast``; never ``eval``) and answers with a ``tool`` message, or with an error message
for a malformed/unknown/invalid call. Its second turn is graded as the final answer. A first turn without
any tool call is graded as the final answer directly.

Reward (``arithmetic_rater``, weights sum to 1): a ``<tool_call>`` block (0.1) that parses (0.15), names
``calculator`` (0.1) and fits its schema (0.15), the tool succeeded (0.1), the answer turn is exactly
``Answer: <number>`` (0.15), the number is right (0.25).
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.toolcall import format_call
from core.types import Message
from envhub import Mode, Rubric, ToolResult
from grpo.environments import BaseEnvironment, State
from grpo.rater import (
    Rollout,
    ToolTraceScore,
    answer_format,
    exact_answer,
    parse_tool_calls,
    schema_errors,
    score_tool_trace,
    tool_index,
)
from rl_client import TurnResult

CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers and + - * ( ).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '12 + 7'"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [CALCULATOR]
SCHEMAS = tool_index(TOOLS)

SYSTEM = "You are a math assistant. First call the calculator tool, then reply with the final answer as 'Answer: N'."
EXAMPLE = (
    {"role": "user", "content": "What is 12 + 7?"},
    {
        "role": "assistant",
        "content": format_call("calculator", {"expression": "12 + 7"}),
    },
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "Answer: 19"},
)

_OPS: dict[type, Callable[[int, int], int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """Evaluate integer ``+ - *`` (and parentheses, unary minus); ValueError for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}") from e

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if max(abs(left), abs(right)) > 10**9:
                raise ValueError("numbers too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression {expression!r}")

    return ev(tree)


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    expression: str
    answer: int

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": self.question}]


def make_problems(n: int, seed: int = 0, max_operand: int = 60, ops: str = "+-", operands: int = 2) -> list[Problem]:
    """``n`` questions ``What is a + b?`` / ``a - b`` with operands in [2, max_operand].

    ``ops`` (any of ``+-*``) and ``operands`` (2-4) make harder ones, e.g. ``What is 37 * 4 - 19?``.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        nums = [rng.randint(2, max_operand) for _ in range(operands)]
        chosen = [rng.choice(list(ops)) for _ in range(operands - 1)]
        expr = " ".join(f"{op} {x}" for op, x in zip(["", *chosen], nums, strict=True)).strip()
        out.append(Problem(f"What is {expr}?", expr, calculate(expr)))
    return out


def run_tool(turn_text: str) -> tuple[str, ToolResult] | None:
    """The environment's reply to a turn: ``(tool message, result)``, or None when it made no call."""
    parsed = parse_tool_calls(turn_text)
    if not parsed.has_block:
        return None
    if not parsed.calls:
        msg = f"error: malformed tool call ({parsed.errors[0] if parsed.errors else 'empty'})"
        return msg, ToolResult("", msg, is_error=True, error_kind="malformed")
    call = parsed.calls[0]
    errors = schema_errors(call, SCHEMAS)
    if errors:
        msg = f"error: invalid call to {call.name!r}: {errors[0]}"
        return msg, ToolResult(call.name, msg, is_error=True, error_kind="invalid")
    try:
        value = str(calculate(str(call.arguments["expression"])))
    except ValueError as e:
        return f"error: {e}", ToolResult(call.name, str(e), is_error=True, error_kind="runtime")
    return value, ToolResult(call.name, value)


class ArithmeticEnv:
    """``grpo.sampler.EpisodeEnv`` for one member: one tool round, then the graded answer."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.texts: list[str] = []
        self.results: list[ToolResult] = []
        self.generated = 0

    def on_turn(self, turn: TurnResult) -> list[dict[str, str]] | None:
        self.texts.append(turn.text)
        self.generated += turn.usage.generated_tokens
        if len(self.texts) > 1:
            return None
        reply = run_tool(turn.text)
        if reply is None:
            return None
        message, result = reply
        self.results.append(result)
        return [{"role": "tool", "content": message}]

    def rollout(self) -> Rollout:
        return Rollout(self.texts, self.results, str(self.problem.answer), self.generated)


class ArithmeticEnvironment(BaseEnvironment):
    """The same task as an ``envhub.Environment`` (``grpo.environments``): seed ``i`` is ``problems[i]``."""

    name = "arithmetic-calculator"
    max_turns = 2

    def __init__(self, problems: Sequence[Problem] | None = None, rater: Rubric[Rollout] | None = None) -> None:
        super().__init__(problems if problems is not None else make_problems(4096))
        self.rater = rater or arithmetic_rater()

    def initial_messages(self, prompt: Any) -> list[Message]:
        return [Message(m["role"], m["content"]) for m in prompt.messages()]

    def prompt_tool_schemas(self) -> list[str]:
        return [json.dumps(t) for t in TOOLS]  # shown to the model; the call is parsed in ``transition``

    def transition(self, state: State, text: str) -> list[Message] | None:
        reply = run_tool(text) if len(state.turns) == 1 else None
        if reply is None:
            return None
        message, result = reply
        state.tool_results.append(result)
        return [Message("tool", message)]

    def rollout(self, state: State) -> Rollout:
        return Rollout(state.turns, state.tool_results, str(state.prompt.answer), int(state.info.get("generated", 0)))

    def score(self, state: State) -> float:
        scored = self.rater.score(self.rollout(state))
        state.info["components"] = dict(scored.terms)
        return scored.total


def _trace(r: Rollout) -> ToolTraceScore:
    return score_tool_trace(r.turns[:1], r.tool_results, SCHEMAS)


def _tool_name(r: Rollout) -> float:
    calls = parse_tool_calls(r.turns[0]).calls if r.turns else ()
    return float(any(c.name == "calculator" for c in calls))


def arithmetic_rater(mode: Mode = "absolute") -> Rubric[Rollout]:
    """Shaped so that partial progress pays: most GRPO groups then hold different rewards (a signal)."""
    return Rubric.weighted(
        {
            "call_emitted": (lambda r: _trace(r).called, 0.1),
            "call_parsed": (lambda r: _trace(r).parsed, 0.15),
            "call_name": (_tool_name, 0.1),
            "call_valid": (lambda r: _trace(r).schema_valid, 0.15),
            "tool_ok": (lambda r: _trace(r).succeeded, 0.1),
            "answer_format": (answer_format, 0.15),
            "correct": (exact_answer, 0.25),
        },
        mode=mode,
    )


__all__ = [
    "CALCULATOR",
    "EXAMPLE",
    "SCHEMAS",
    "SYSTEM",
    "TOOLS",
    "ArithmeticEnv",
    "ArithmeticEnvironment",
    "Problem",
    "arithmetic_rater",
    "calculate",
    "make_problems",
    "run_tool",
]
