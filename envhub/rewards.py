"""Env shaping terms: graders (``envhub.graders.Grader``) of a finished episode's ``RewardContext``.

Invariants:
- Every term is a pure function of a ``RewardContext`` (deterministic, no I/O), so a trainer can
  re-score recorded episodes and get the same number.
- An environment sums its terms with a ``Rubric`` (weights 1, ``mean=False``) whose ``score`` returns the
  total and the per-term values; the ready environments clip to [0, 1] (``default_shaping``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from envhub.graders import Grader, Rubric
from envhub.types import ToolTraceEntry

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> tuple[str, bool]:
    """The final answer inside ``<answer>...</answer>`` (and True), else the stripped text (and False)."""
    m = ANSWER_RE.search(text)
    if m is not None:
        return m.group(1).strip(), True
    return text.strip(), False


@dataclass(frozen=True, slots=True)
class RewardContext:
    """Everything a shaper may look at."""

    success: float  # the grader's score in [0, 1]
    format_ok: bool
    steps: int  # tool calls executed
    tool_seconds: float
    trace: tuple[ToolTraceEntry, ...] = ()
    truncated: bool = False  # the tool-call bound ended the episode


@dataclass(frozen=True, slots=True)
class Success:
    """``weight * grader score``."""

    weight: float = 1.0
    name: str = "success"

    def __call__(self, ctx: RewardContext) -> float:
        return self.weight * ctx.success


@dataclass(frozen=True, slots=True)
class FormatBonus:
    """``bonus`` when the answer used the expected format, ``-penalty`` otherwise."""

    bonus: float = 0.0
    penalty: float = 0.1
    name: str = "format"

    def __call__(self, ctx: RewardContext) -> float:
        return self.bonus if ctx.format_ok else -self.penalty


@dataclass(frozen=True, slots=True)
class StepPenalty:
    """``-per_step`` for each tool call beyond ``free_steps``; ``truncation`` more if the bound was hit."""

    per_step: float = 0.02
    free_steps: int = 1
    truncation: float = 0.0
    name: str = "steps"

    def __call__(self, ctx: RewardContext) -> float:
        return -self.per_step * max(0, ctx.steps - self.free_steps) - (self.truncation if ctx.truncated else 0.0)


@dataclass(frozen=True, slots=True)
class CostPenalty:
    """``-per_second`` of tool wall time (sandbox, browser and SQL time cost money)."""

    per_second: float = 0.01
    name: str = "cost"

    def __call__(self, ctx: RewardContext) -> float:
        return -self.per_second * ctx.tool_seconds


@dataclass(frozen=True, slots=True)
class ToolTrace:
    """Tool-trace terms: ``-per_error`` per failed call, ``bonus`` if every tool in ``required`` was used."""

    per_error: float = 0.05
    required: tuple[str, ...] = ()
    bonus: float = 0.0
    name: str = "tool_trace"

    def __call__(self, ctx: RewardContext) -> float:
        errors = sum(1 for t in ctx.trace if not t.ok)
        used = {t.name for t in ctx.trace if t.ok}
        got_bonus = bool(self.required) and all(r in used for r in self.required)
        return -self.per_error * errors + (self.bonus if got_bonus else 0.0)


Shaping = Rubric[RewardContext]  # an environment's reward: its shaping terms summed


def default_shaping(*terms: Grader[RewardContext]) -> Shaping:
    """The ready environments' reward: the sum of ``terms`` (default: the grader's score) clipped to [0, 1]."""
    return Rubric(terms or (Success(),), clip=(0.0, 1.0), name="shaping")
