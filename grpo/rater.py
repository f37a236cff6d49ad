"""GRPO reward functions: graders of a finished ``Rollout``, combined by envhub's ``Rubric``.

A reward function maps one finished ``Rollout`` (its assistant turns' text, the tool results the
environment returned, the task's expected answer) to a float in [0, 1]. They are combined by the env hub's
one reward system (``envhub.Rubric.weighted``: a weighted mean, then per group ``absolute``,
``group_relative`` or ``pareto``), the same that shapes the environments' rewards; tool results are
``envhub.ToolResult``. Per-turn rewards come from ``turn_rewards``: the tool-trace score of each turn.

Tool calls are parsed by the format's one parser (``core.toolcall.parse_tool_calls``: ``<tool_call>`` blocks
whose payload is ``{"name", "arguments"}`` or a JSON list of those; an unterminated block is parsed as far
as it goes), so training rewards read a turn exactly as the environment that ran it did. Arguments are
validated against the tool's JSON schema (``jsonschema``).
Invariant: no reward function raises for anything a model wrote.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from core.toolcall import TOOL_CALL_BEGIN, ToolCall, strip_end_markers
from core.toolcall import parse_tool_calls as _parse_format
from envhub import ToolResult

_NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """The tool calls of one turn: well-formed ones and one error per malformed block or entry."""

    has_block: bool
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


@dataclass
class Rollout:
    """One finished episode as the rater sees it."""

    turns: list[str]  # assistant text per turn (end markers allowed)
    tool_results: list[ToolResult] = field(default_factory=list)
    expected: str | None = None  # the task's answer, when it has one
    generated_tokens: int = 0


def strip_end(text: str) -> str:
    """``text`` without trailing end-of-turn markers and whitespace."""
    return strip_end_markers(text)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Parse every ``<tool_call>`` block of ``text`` (never raises)."""
    parsed = _parse_format(strip_end(text))
    if parsed is None:
        return ParsedTurn(False, (), ())
    return ParsedTurn(True, parsed.calls, parsed.errors)


def schema_errors(call: ToolCall, schemas: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Why ``call`` does not fit its tool's schema (empty when it does); ``schemas`` maps name -> tool spec."""
    spec = schemas.get(call.name)
    if spec is None:
        return [f"unknown tool {call.name!r}"]
    params = spec.get("function", spec).get("parameters", {"type": "object"})
    validator = jsonschema.Draft202012Validator(params)
    return [e.message for e in validator.iter_errors(call.arguments)]


def tool_index(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """name -> tool spec, for OpenAI-style ``{"type": "function", "function": {...}}`` or bare specs."""
    return {str(t.get("function", t)["name"]): t for t in tools}


@dataclass(frozen=True, slots=True)
class ToolTraceScore:
    """Fractions in [0, 1]; ``called`` is 1 when any block was emitted."""

    called: float
    parsed: float  # well-formed calls / (calls + malformed blocks)
    schema_valid: float  # calls valid against their schema / calls
    succeeded: float  # tool results ok / results (0 when nothing ran)


def score_tool_trace(
    turns: Sequence[str], results: Sequence[ToolResult], schemas: Mapping[str, Mapping[str, Any]]
) -> ToolTraceScore:
    parsed = [parse_tool_calls(t) for t in turns]
    calls = [c for p in parsed for c in p.calls]
    n_err = sum(len(p.errors) for p in parsed)
    if not any(p.has_block for p in parsed):
        return ToolTraceScore(0.0, 0.0, 0.0, 0.0)
    total = len(calls) + n_err
    valid = sum(not schema_errors(c, schemas) for c in calls)
    return ToolTraceScore(
        called=1.0,
        parsed=len(calls) / total if total else 0.0,
        schema_valid=valid / len(calls) if calls else 0.0,
        succeeded=sum(r.ok for r in results) / len(results) if results else 0.0,
    )


RewardFn = Callable[[Rollout], float]


def tool_trace_reward(
    schemas: Mapping[str, Mapping[str, Any]], weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
) -> RewardFn:
    """Weighted (parsed, schema-valid, succeeded) of the episode's tool trace."""

    def fn(r: Rollout) -> float:
        s = score_tool_trace(r.turns, r.tool_results, schemas)
        return weights[0] * s.parsed + weights[1] * s.schema_valid + weights[2] * s.succeeded

    return fn


def final_answer(text: str) -> str | None:
    """The number after ``Answer:`` in the last turn, else None (a turn with a tool call is not an answer)."""
    t = strip_end(text)
    if TOOL_CALL_BEGIN in t:
        return None
    m = re.search(r"answer\s*(?:is)?\s*[:=]?\s*(" + _NUMBER + ")", t, re.IGNORECASE)
    return m.group(1) if m else None


def exact_answer(r: Rollout) -> float:
    """1 when the last turn's ``Answer: N`` equals the expected answer numerically."""
    if r.expected is None or not r.turns:
        return 0.0
    got = final_answer(r.turns[-1])
    if got is None:
        return 0.0
    try:
        return float(abs(float(got) - float(r.expected)) < 1e-6)
    except ValueError:
        return 0.0


def answer_format(r: Rollout) -> float:
    """1 when the last turn is exactly ``Answer: <number>`` (nothing else)."""
    if not r.turns:
        return 0.0
    return float(re.fullmatch(r"\s*Answer:\s*" + _NUMBER + r"\s*", strip_end(r.turns[-1])) is not None)


def length_penalty(budget: int) -> RewardFn:
    """1 within ``budget`` generated tokens, falling linearly to 0 at twice the budget."""

    def fn(r: Rollout) -> float:
        over = max(0, r.generated_tokens - budget)
        return max(0.0, 1.0 - over / max(1, budget))

    return fn


def turn_rewards(r: Rollout, schemas: Mapping[str, Mapping[str, Any]]) -> list[float]:
    """Per-turn reward: a turn with tool calls scores its (parsed + schema-valid) / 2, others 0."""
    out = []
    for t in r.turns:
        s = score_tool_trace([t], [], schemas)
        out.append(0.5 * (s.parsed + s.schema_valid) if s.called else 0.0)
    return out


__all__ = [
    "ParsedTurn",
    "RewardFn",
    "Rollout",
    "ToolCall",
    "ToolTraceScore",
    "answer_format",
    "exact_answer",
    "final_answer",
    "length_penalty",
    "parse_tool_calls",
    "schema_errors",
    "score_tool_trace",
    "strip_end",
    "tool_index",
    "tool_trace_reward",
    "turn_rewards",
]
