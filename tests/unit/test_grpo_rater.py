"""grpo.rater and grpo.tasks: tool-call parsing, schema checks, tool-trace scores (on real recorded
SmolLM2 outputs, tests/data/grpo_tool_outputs.json), reward functions, rater modes, the calculator env."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from envhub import Rubric, ToolResult, pareto_fronts
from grpo.rater import (
    Rollout,
    ToolCall,
    answer_format,
    exact_answer,
    final_answer,
    length_penalty,
    parse_tool_calls,
    schema_errors,
    score_tool_trace,
    tool_trace_reward,
)
from grpo.tasks import SCHEMAS, arithmetic_rater, calculate, make_problems, run_tool

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "grpo_tool_outputs.json"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>'


def test_parse_accepts_object_list_parameters_and_string_arguments() -> None:
    assert parse_tool_calls(CALL).calls == (ToolCall("calculator", {"expression": "3 + 4"}),)
    listed = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]</tool_call>'
    assert [c.name for c in parse_tool_calls(listed).calls] == ["a", "b"]
    assert parse_tool_calls(listed).calls[1].arguments == {"x": 1}
    as_string = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'
    assert parse_tool_calls(as_string).calls[0].arguments == {"x": 2}


def test_parse_reports_malformed_blocks_and_tolerates_truncation() -> None:
    p = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1 +')
    assert p.has_block and not p.calls and p.errors
    cut = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool')  # max_tokens mid-tag
    assert cut.calls == (ToolCall("f", {"a": 1}),) and not cut.errors
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>").errors
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').errors
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>').errors
    none = parse_tool_calls("Answer: 7<|im_end|>")
    assert not none.has_block and not none.calls and not none.errors


def test_schema_errors_name_the_problem() -> None:
    assert schema_errors(ToolCall("calculator", {"expression": "1 + 1"}), SCHEMAS) == []
    assert "unknown tool" in schema_errors(ToolCall("math", {"expression": "1"}), SCHEMAS)[0]
    assert schema_errors(ToolCall("calculator", {}), SCHEMAS)  # required property missing
    assert schema_errors(ToolCall("calculator", {"expression": 5}), SCHEMAS)  # wrong type
    assert schema_errors(ToolCall("calculator", {"expression": "1", "x": 1}), SCHEMAS)  # additionalProperties


def test_tool_trace_score_fractions() -> None:
    two = CALL + '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call><tool_call>{bad'
    s = score_tool_trace([two], [ToolResult("calculator", "7"), ToolResult("calculator", "e", is_error=True)], SCHEMAS)
    assert (s.called, s.parsed, s.schema_valid, s.succeeded) == (1.0, 2 / 3, 0.5, 0.5)
    assert score_tool_trace(["no call"], [], SCHEMAS).called == 0.0
    fn = tool_trace_reward(SCHEMAS)
    assert fn(Rollout([CALL], [ToolResult("calculator", "7")])) == pytest.approx(1.0)


def _recorded() -> list[dict[str, object]]:
    data = json.loads(FIXTURE.read_text())
    assert data["engine"] == "embedded" and "SmolLM2" in str(data["model"])
    return list(data["samples"])


def test_recorded_outputs_cover_valid_malformed_and_wrong_schema_calls() -> None:
    cats = {s["category"] for s in _recorded()}
    assert {"valid", "malformed", "wrong_schema", "no_call"} <= cats


@pytest.mark.parametrize("sample", _recorded(), ids=lambda s: f"{s['category']}-{s['seed']}-{s['member']}")
def test_tool_trace_scoring_on_recorded_engine_outputs(sample: dict[str, object]) -> None:
    text = str(sample["text"])
    category = sample["category"]
    parsed = parse_tool_calls(text)
    reply = run_tool(text)
    trace = score_tool_trace([text], [reply[1]] if reply else [], SCHEMAS)
    if category == "no_call":
        assert reply is None and trace.called == 0.0
    elif category == "malformed":
        assert reply is not None and not reply[1].ok and reply[0].startswith("error: malformed")
        assert trace.called == 1.0 and trace.parsed < 1.0 and trace.succeeded == 0.0
    elif category == "wrong_schema":
        assert parsed.calls and not parsed.errors and trace.parsed == 1.0 and trace.schema_valid < 1.0
        assert reply is not None and not reply[1].ok and reply[0].startswith("error: invalid call")
    else:
        assert category == "valid"
        assert trace.parsed == 1.0 and trace.schema_valid == 1.0
        assert reply is not None and reply[1].ok and reply[0] == str(calculate(parsed.calls[0].arguments["expression"]))


def test_answer_functions() -> None:
    assert final_answer("Answer: 42<|im_end|>") == "42"
    assert final_answer("The answer is -3.") == "-3"
    assert final_answer(CALL) is None
    assert exact_answer(Rollout(["x", "Answer: 42<|im_end|>"], expected="42")) == 1.0
    assert exact_answer(Rollout(["Answer: 41"], expected="42")) == 0.0
    assert exact_answer(Rollout(["Answer: 42"], expected=None)) == 0.0
    assert answer_format(Rollout(["Answer: 42<|im_end|>"])) == 1.0
    assert answer_format(Rollout(["Answer: 42, I think"])) == 0.0
    lp = length_penalty(10)
    assert [lp(Rollout([], generated_tokens=n)) for n in (5, 10, 15, 20, 40)] == [1.0, 1.0, 0.5, 0.0, 0.0]


def test_rater_modes() -> None:
    rater = Rubric.weighted(
        {"a": (lambda r: float(r.turns[0] == "a"), 3.0), "len": (lambda r: min(1.0, len(r.turns) / 2), 1.0)}
    )
    group = [Rollout(["a"]), Rollout(["b", "c"]), Rollout(["a", "c"])]
    assert rater.rate_group(group) == [0.875, 0.25, 1.0]
    rater.mode = "group_relative"
    assert rater.rate_group(group) == [pytest.approx(0.625 / 0.75), 0.0, 1.0]
    assert rater.rate_group([Rollout(["a"])] * 3) == [0.0] * 3
    rater.mode = "pareto"
    # (1, .5), (0, 1), (1, 1): the third dominates both others, which do not dominate each other
    assert rater.rate_group(group) == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        Rubric.weighted({})


def test_pareto_fronts_match_brute_force() -> None:
    rng = random.Random(1)
    for _ in range(200):
        pts = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(3)] for _ in range(rng.randint(1, 8))]
        fronts = pareto_fronts(pts)

        def dom(a: list[float], b: list[float]) -> bool:
            return all(x >= y for x, y in zip(a, b, strict=True)) and a != b

        for i, j in itertools.permutations(range(len(pts)), 2):
            if dom(pts[i], pts[j]):
                assert fronts[i] < fronts[j]
        assert 0 in fronts


def test_calculator_is_safe_and_exact() -> None:
    assert calculate("12 + 7") == 19 and calculate("-(3 - 10) * 2") == 14
    for bad in ("__import__('os')", "2 ** 10", "1 / 2", "x + 1", "1.5 + 1", "", "9" * 12 + " * 9"):
        with pytest.raises(ValueError):
            calculate(bad)
    for p in make_problems(50, seed=3):
        assert calculate(p.expression) == p.answer and p.question == f"What is {p.expression}?"


def test_arithmetic_rater_orders_partial_progress() -> None:
    r = arithmetic_rater()
    ok = ToolResult("calculator", "7")
    full = Rollout([CALL, "Answer: 7<|im_end|>"], [ok], "7")
    wrong_answer = Rollout([CALL, "Answer: 8"], [ok], "7")
    no_tool = Rollout(["Answer: 7"], [], "7")
    garbage = Rollout(["hello"], [], "7")
    scores = [r.absolute(x) for x in (full, wrong_answer, no_tool, garbage)]
    assert scores[0] == pytest.approx(1.0) and scores[0] > scores[1] > scores[2] > scores[3] == 0.0
