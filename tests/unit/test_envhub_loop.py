"""The server-side tool loop: parsing tool calls, executing them, grading, the bound."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from core.errors import FailedPrecondition, ToolError
from core.toolcall import parse_tool_calls, strip_tool_calls
from envhub.base import Task, ToolEnvironment
from envhub.config import EnvHubConfig, LoopConfig
from envhub.loop import ToolLoop, start_env_episode
from envhub.types import JSON, FinalAnswer, ToolCall, ToolResult, ToolSpec

ADD = ToolSpec(
    name="add",
    description="Add two integers.",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


class CalcEnv(ToolEnvironment):
    """A real (tiny) tool environment: one tool, graded on the sum 2 + 3."""

    name = "calc"

    def __init__(self) -> None:
        super().__init__((Task("t1", "What is 2 + 3?", "5"),))
        self.add_tool(ADD, self._add)
        self.calls: list[tuple[int, int]] = []

    async def _add(self, args: Mapping[str, JSON]) -> ToolResult:
        a, b = int(args["a"]), int(args["b"])
        if a < 0:
            raise ToolError("negative numbers are refused", kind="refused")
        self.calls.append((a, b))
        return ToolResult("add", str(a + b))

    def grade(self, task: Task, answer: str) -> float:
        return 1.0 if answer.strip() == task.reference else 0.0


def call(name: str = "add", **args: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_parse_generic_smollm2_and_variants() -> None:
    assert parse_tool_calls("no call here") is None
    p = parse_tool_calls('Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert p is not None and p.calls == (ToolCall("add", {"a": 1, "b": 2}),) and not p.errors
    # SmolLM2 emits a JSON list of calls; "parameters" and string-encoded arguments are accepted.
    p = parse_tool_calls(
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "add", "parameters": "{\\"a\\": 3, \\"b\\": 4}"}]</tool_call>'
    )
    assert p is not None and [c.arguments for c in p.calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    # Unterminated (the turn hit max_tokens) is parsed as far as it goes.
    p = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}')
    assert p is not None and len(p.calls) == 1
    p = parse_tool_calls('<tool_call>{not json</tool_call><tool_call>[1, {"x": 2}]</tool_call>')
    assert p is not None and not p.calls and len(p.errors) == 3
    assert "not valid JSON" in p.errors[0]
    assert strip_tool_calls("answer " + call(a=1, b=2)) == "answer"


async def test_tool_call_then_final_answer_is_graded() -> None:
    env = CalcEnv()
    await env.reset()
    loop = ToolLoop(env, LoopConfig(max_tool_calls=4))
    d = await loop.on_turn("I will add. " + call(a=2, b=3))
    assert d.should_continue and not d.done and d.reason == "tool_call" and d.tool_calls == 1
    assert [(m.role, m.name, m.content) for m in d.observation] == [("tool", "add", "5")]
    d = await loop.on_turn("The sum is <answer>5</answer>")
    assert not d.should_continue and d.done and d.reason == "final_answer" and d.reward == 1.0
    assert env.state().done and env.state().step_count == 1 and env.calls == [(2, 3)]
    # Further turns are no-ops; the environment itself refuses steps after done.
    d = await loop.on_turn(call(a=1, b=1))
    assert not d.should_continue and d.reason == "done" and env.calls == [(2, 3)]
    with pytest.raises(FailedPrecondition):
        await env.step(FinalAnswer("5"))


async def test_wrong_answer_scores_zero() -> None:
    env = CalcEnv()
    await env.reset()
    d = await ToolLoop(env).on_turn("<answer>6</answer>")
    assert d.done and d.reward == 0.0


async def test_decoded_end_marker_is_ignored() -> None:
    env = CalcEnv()
    await env.reset()
    d = await ToolLoop(env).on_turn("5<|im_end|>\n")  # a bare answer, decoded with its EOS token
    assert d.done and d.reward == 1.0


async def test_tool_errors_are_observations() -> None:
    env = CalcEnv()
    await env.reset()
    loop = ToolLoop(env)
    d = await loop.on_turn(call(a=-1, b=2) + call("nope", a=1) + call(a=1) + "<tool_call>{oops</tool_call>")
    assert d.should_continue
    contents = [m.content for m in d.observation]
    assert contents[0].startswith("error (invalid): tool call is not valid JSON")
    assert contents[1] == "error (refused): negative numbers are refused"
    assert contents[2].startswith("error: unknown tool 'nope'")
    assert contents[3] == "error (invalid): add: missing required argument 'b'"
    assert [t.ok for t in env.state().trace] == [False, False, False]


async def test_bound_on_tool_calls_per_episode_and_per_turn() -> None:
    env = CalcEnv()
    await env.reset()
    loop = ToolLoop(env, LoopConfig(max_tool_calls=3, max_calls_per_turn=2))
    d = await loop.on_turn(call(a=1, b=1) + call(a=2, b=2) + call(a=3, b=3))
    assert d.tool_calls == 2 and d.observation[-1].content.startswith("error (limit)")
    d = await loop.on_turn(call(a=4, b=4) + call(a=5, b=5))
    assert d.tool_calls == 1 and d.should_continue  # only 1 left in the episode budget
    d = await loop.on_turn("still calling " + call(a=6, b=6))
    assert not d.should_continue and d.done and d.truncated and d.reason == "max_tool_calls"
    assert d.reward == 0.0 and env.calls == [(1, 1), (2, 2), (4, 4)]
    assert loop.turns == 3


async def test_loop_terminates_within_bound_plus_one_turns() -> None:
    env = CalcEnv()
    await env.reset()
    loop = ToolLoop(env, LoopConfig(max_tool_calls=5, max_calls_per_turn=1))
    turns = 0
    while True:
        turns += 1
        d = await loop.on_turn(call(a=1, b=2))
        if not d.should_continue:
            break
        assert turns <= 5
    assert turns == 6 and d.truncated


async def test_malformed_calls_count_toward_the_bound() -> None:
    """A model that only writes broken tool calls still ends within max_tool_calls + 1 turns."""
    env = CalcEnv()
    await env.reset()
    loop = ToolLoop(env, LoopConfig(max_tool_calls=3, max_calls_per_turn=2))
    d = await loop.on_turn("<tool_call>{oops</tool_call>")
    assert d.should_continue and d.tool_calls == 0 and d.observation[0].content.startswith("error (invalid)")
    d = await loop.on_turn("<tool_call>[]</tool_call>")  # an empty list of calls: also a call gone wrong
    assert d.should_continue and d.observation[0].content == "error (invalid): empty tool call"
    d = await loop.on_turn("<tool_call>[1, 2]</tool_call>" + call(a=1, b=1))  # two malformed entries, one good call
    assert d.should_continue and d.tool_calls == 1 and env.calls == [(1, 1)]
    d = await loop.on_turn("<tool_call>{oops</tool_call>")
    assert not d.should_continue and d.done and d.truncated and d.reason == "max_tool_calls"
    assert loop.turns == 4 and loop.tool_calls == 1


async def test_start_env_episode_gives_the_bridge_prompt_tools_and_loop() -> None:
    ep = await start_env_episode("sql-qa", EnvHubConfig(loop=LoopConfig(max_tool_calls=2)), task_id="sql-7")
    assert ep.prompt_messages[-1].content == "Which employee was hired first?"
    assert json.loads(ep.tool_schemas[0])["function"]["name"] == "sql_query"
    assert ep.grammar.tool_names == ("sql_query",) and ep.loop.config.max_tool_calls == 2
    d = await ep.loop.on_turn(call("sql_query", query="SELECT name FROM employees ORDER BY hired LIMIT 1"))
    assert d.observation[0].content == "name\nCarl Gauss"
    d = await ep.loop.on_turn("<answer>Carl Gauss</answer>")
    assert d.done and d.reward == 1.0
    await ep.close()


def test_a_string_argument_may_contain_the_end_tag() -> None:
    """The grammar allows ``</tool_call>`` inside a JSON string; the block ends where the JSON value ends."""
    text = 'Let me check.<tool_call>\n{"name": "echo", "arguments": {"text": "a</tool_call>b"}}\n</tool_call> done'
    parsed = parse_tool_calls(text)
    assert parsed is not None and not parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [("echo", {"text": "a</tool_call>b"})]
    assert strip_tool_calls(text) == "Let me check. done"
    # Malformed JSON still ends at the first end tag, and an unterminated block runs to the end.
    bad = parse_tool_calls('<tool_call>{"name": oops}</tool_call> then <tool_call>{"name": "echo", "argu')
    assert bad is not None and len(bad.errors) == 2 and not bad.calls


def test_a_turn_cut_inside_the_end_tag_still_parses() -> None:
    """max_tokens may stop a turn after the JSON but inside ``</tool_call>``: the call is complete."""
    for cut in ("", "</", "</tool", "</tool_call"):
        text = 'ok <tool_call>{"name": "echo", "arguments": {"text": "hi"}}' + cut
        parsed = parse_tool_calls(text)
        assert parsed is not None and not parsed.errors, cut
        assert [(c.name, c.arguments) for c in parsed.calls] == [("echo", {"text": "hi"})]
        assert strip_tool_calls(text) == "ok"
    # Text after the JSON that is not the end tag: the block runs to the end and is malformed.
    bad = parse_tool_calls('<tool_call>{"name": "echo", "arguments": {}} </tool_cat')
    assert bad is not None and bad.errors and not bad.calls
