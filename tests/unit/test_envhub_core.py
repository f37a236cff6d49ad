"""Env hub core: reward shapers, graders, schema grammars, the registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import InvalidArgument
from core.toolcall import TOOL_CALL_BEGIN, parse_tool_calls
from envhub import EnvHubConfig, make_env, names, register
from envhub.base import Task, ToolEnvironment
from envhub.graders import Rubric, grade_exact
from envhub.grammar import grammar_for
from envhub.rewards import (
    CostPenalty,
    FormatBonus,
    RewardContext,
    StepPenalty,
    Success,
    ToolTrace,
    extract_answer,
)
from envhub.types import FinalAnswer, ToolTraceEntry


def test_shaper_terms_and_clip() -> None:
    trace = (ToolTraceEntry("sql_query", True, 0.5), ToolTraceEntry("sql_query", False, 0.5, "refused"))
    ctx = RewardContext(success=1.0, format_ok=False, steps=3, tool_seconds=1.0, trace=trace)
    shaper = Rubric(
        (
            Success(),
            FormatBonus(penalty=0.1),
            StepPenalty(per_step=0.05, free_steps=1),
            CostPenalty(per_second=0.02),
            ToolTrace(per_error=0.1, required=("sql_query",), bonus=0.2),
        ),
        clip=None,
    )
    out = shaper.score(ctx)
    assert dict(out.terms) == pytest.approx(
        {"success": 1.0, "format": -0.1, "steps": -0.1, "cost": -0.02, "tool_trace": 0.1}
    )
    assert out.total == pytest.approx(0.88)
    assert Rubric((Success(weight=2.0),), clip=(0.0, 1.0)).score(ctx).total == 1.0  # clipped to [0, 1]
    truncated = RewardContext(0.0, True, 9, 0.0, truncated=True)
    assert StepPenalty(per_step=0.0, truncation=0.3)(truncated) == -0.3


def test_extract_answer_and_graders() -> None:
    assert extract_answer("blah <answer> 42 </answer> tail") == ("42", True)
    assert extract_answer("  42 ") == ("42", False)
    cases = {
        ("3", "3"): 1.0,
        ("3.0", "3"): 1.0,
        ("6,733", "6733"): 1.0,
        ("grace hopper.", "Grace Hopper"): 1.0,
        ("It was Grace Hopper", "Grace Hopper"): 0.5,
        ("The answer is 3", "3"): 0.5,
        ("13", "3"): 0.0,
        ("GG-30031", "GG-3003"): 0.0,
        ("", "3"): 0.0,
    }
    for (answer, ref), want in cases.items():
        assert grade_exact(answer, ref) == want, (answer, ref)
        assert 0.0 <= grade_exact(answer, ref) <= 1.0


def test_grammar_matches_what_the_loop_parses() -> None:
    env = make_env("sql-qa")
    grammar = grammar_for(env.name, env.tools())
    assert grammar.tool_names == ("sql_query",)
    schema = grammar.call_schema()
    assert schema["properties"]["name"] == {"const": "sql_query"}
    assert schema["properties"]["arguments"]["required"] == ["query"]
    assert json.loads(grammar.to_json())["begin"] == TOOL_CALL_BEGIN
    # A call built from the grammar's pieces is one the loop parses.
    text = grammar.begin + json.dumps({"name": "sql_query", "arguments": {"query": "SELECT 1"}}) + grammar.end
    parsed = parse_tool_calls(text)
    assert parsed is not None and parsed.calls[0].name == "sql_query"
    two = grammar_for("x", (*env.tools(), *make_env("code-math").tools())).call_schema()
    assert [b["properties"]["name"]["const"] for b in two["anyOf"]] == ["sql_query", "run_python"]


class _Echo(ToolEnvironment):
    name = "echo"

    def grade(self, task: Task, answer: str) -> float:
        return float(answer == task.reference)


async def test_registry() -> None:
    assert {"sql-qa", "code-math", "web-lookup", "web-browse"} <= set(names())
    with pytest.raises(InvalidArgument, match="unknown environment"):
        make_env("nope")
    register("echo-test", lambda _cfg: _Echo((Task("a", "say hi", "hi"), Task("b", "say yo", "yo"))))
    env = make_env("echo-test", EnvHubConfig())
    opening = await env.reset(seed=1)
    assert opening.task_id == "b" and opening.messages[-1].content == "say yo"
    assert (await env.step(FinalAnswer("<answer>yo</answer>"))).reward == 1.0
    with pytest.raises(InvalidArgument):
        await env.reset(task_id="zzz")
    assert make_env("echo-test") is not env  # a fresh instance per call


async def test_tasks_dir_replaces_the_bundled_tasks(tmp_path: Path) -> None:
    (tmp_path / "sql_qa.json").write_text(json.dumps([{"task_id": "mine", "question": "Q?", "reference": "10"}]))
    env = make_env("sql-qa", EnvHubConfig(tasks_dir=str(tmp_path)))
    opening = await env.reset()
    assert opening.task_id == "mine" and opening.messages[-1].content == "Q?"
    await env.close()


async def test_ready_env_tasks_have_prompts_and_tools() -> None:
    for name in ("sql-qa", "code-math", "web-lookup", "web-browse"):
        env = make_env(name)
        opening = await env.reset()
        assert opening.messages[0].role == "system" and "<tool_call>" in opening.messages[0].content
        assert opening.messages[-1].role == "user" and opening.tools
        await env.close()


async def test_graders_register_by_name_and_environments_grade_with_theirs() -> None:
    from envhub import Answer, FnGrader, get_grader, register_grader

    assert get_grader("exact")(Answer("The answer is 3", "3")) == 0.5
    with pytest.raises(InvalidArgument, match=r"unknown grader 'nope'; registered: .*exact"):
        get_grader("nope")
    with pytest.raises(InvalidArgument, match="already registered"):
        register_grader(FnGrader("exact", lambda a: 1.0))
    shout = FnGrader("shout-test", lambda a: float(a.text == a.reference.upper()))
    register_grader(shout)
    assert get_grader("shout-test") is shout

    class Shout(ToolEnvironment):
        grader = shout

    env = Shout((Task("a", "say hi", "hi"),))
    await env.reset()
    assert (await env.step(FinalAnswer("<answer>HI</answer>"))).reward == 1.0
