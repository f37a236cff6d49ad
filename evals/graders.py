"""The eval tasks' graders that are not built into ``envhub.graders``: registered on import.

``grpo-arithmetic``: the GRPO demo's rater (``grpo.tasks.arithmetic_rater``, the same ``envhub.Rubric`` the
trainer rates with) as a verifier grader. Its sample is a ``VerdictSample`` whose params carry the episode
as the rater sees it: ``turns`` (assistant text per turn), ``tool_results`` (``{name, content, is_error,
error_kind}``) and ``reference`` (the expected answer). grpo is imported when the grader first runs, so
importing this module (and envhub) does not import grpo.
"""

from __future__ import annotations

from typing import Any

from envhub.graders import FnGrader, grader_names, register_grader
from envhub.types import ToolResult


def grade_arithmetic(sample: Any) -> float:
    from grpo.rater import Rollout
    from grpo.tasks import arithmetic_rater

    p = sample.params
    results = [
        ToolResult(str(r["name"]), str(r["content"]), bool(r.get("is_error")), str(r.get("error_kind", "")))
        for r in p.get("tool_results", [])
    ]
    rollout = Rollout([str(t) for t in p.get("turns", [])], results, str(p.get("reference", "")))
    return float(arithmetic_rater()(rollout))


GRPO_ARITHMETIC = FnGrader("grpo-arithmetic", grade_arithmetic)

if GRPO_ARITHMETIC.name not in grader_names():
    register_grader(GRPO_ARITHMETIC)
