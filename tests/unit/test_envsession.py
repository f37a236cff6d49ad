"""The bridge's per-episode env state (server.envsession): failures, deadlines and resumption of a tool loop.

The environments here are real (tiny) ``ToolEnvironment``s whose tools misbehave on purpose; the
bridge-level flow is covered by tests/integration/test_envhub_toolloop.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest

from core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ToolError
from envhub.base import Task, ToolEnvironment
from envhub.config import EnvHubConfig, LoopConfig
from envhub.loop import EnvEpisode, ToolLoop
from envhub.types import JSON, Action, ToolCall, ToolResult, ToolSpec
from server.envsession import EnvSession, open_env_sessions

SPEC = ToolSpec("probe", "A tool that misbehaves as told.", {"type": "object", "properties": {}})


class ProbeEnv(ToolEnvironment):
    name = "probe"

    def __init__(self) -> None:
        super().__init__((Task("t1", "Probe.", "ok"),))
        self.add_tool(SPEC, self._probe)
        self.mode = "ok"
        self.calls = 0

    async def _probe(self, args: Mapping[str, JSON]) -> ToolResult:
        self.calls += 1
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.mode == "crash":
            raise RuntimeError("the probe's backend is gone")
        return ToolResult("probe", "fine")

    def grade(self, task: Task, answer: str) -> float:
        return 1.0 if answer.strip() == task.reference else 0.0


class LeakyEnv(ProbeEnv):
    """An environment that lets a ToolError escape ``step`` (as a remote one may)."""

    async def step(self, action: Action) -> object:  # type: ignore[override]
        if isinstance(action, ToolCall):
            raise ToolError("the remote environment refused the call", kind="refused")
        return await super().step(action)


async def _session(env: ProbeEnv, max_tool_calls: int = 4) -> EnvSession:
    loop = ToolLoop(env, LoopConfig(max_tool_calls=max_tool_calls))
    opening = await env.reset()
    return EnvSession("probe", EnvEpisode(loop, opening), max_turns=2 * (max_tool_calls + 1))


CALL = "<tool_call>" + json.dumps({"name": "probe", "arguments": {}}) + "</tool_call>"


async def test_a_crashing_tool_stops_the_loop_with_env_error_and_further_steps_are_refused() -> None:
    env = ProbeEnv()
    env.mode = "crash"
    session = await _session(env)
    assert await session.run_turn(CALL, None) is None
    assert session.stopped == "env_error" and "the probe's backend is gone" in session.error
    assert session.pending is None
    outcome = session.outcome(turns=1)
    assert not outcome.done and outcome.reason == "env_error" and outcome.reward is None
    with pytest.raises(FailedPrecondition, match="env_error"):
        session.check_steppable("ep-1")
    assert session.metadata()["env.reason"] == "env_error" and "env.error" in session.metadata()


async def test_a_tool_error_that_escapes_the_env_becomes_an_error_observation() -> None:
    session = await _session(LeakyEnv())
    decision = await session.run_turn(CALL, None)
    assert decision is not None and decision.should_continue and not session.stopped
    assert [m.content for m in decision.observation] == ["error (refused): the remote environment refused the call"]
    session.check_steppable("ep-1")  # still running


async def test_a_deadline_during_tool_calls_keeps_them_pending_and_they_run_on_the_next_turn() -> None:
    env = ProbeEnv()
    env.mode = "slow"
    session = await _session(env)
    with pytest.raises(DeadlineExceeded):
        await session.run_turn(CALL, asyncio.get_running_loop().time() + 0.05)
    assert session.pending == CALL and not session.stopped
    env.mode = "ok"
    decision = await session.run_turn(session.pending, None)
    assert decision is not None and decision.should_continue and [m.content for m in decision.observation] == ["fine"]
    assert session.pending is None and session.loop.tool_calls == 1


async def test_graded_bound_and_turn_cap() -> None:
    session = await _session(ProbeEnv(), max_tool_calls=1)
    assert (await session.run_turn(CALL, None)) is not None and not session.stopped
    decision = await session.run_turn(CALL, None)  # over the bound: graded with the call stripped
    assert decision is not None and decision.done and decision.truncated
    assert session.stopped == "max_tool_calls" and session.outcome(2).done
    with pytest.raises(FailedPrecondition, match="already graded"):
        session.check_steppable("ep-1")

    # Malformed calls count toward the bound: a model writing only broken calls is graded after it.
    session = await _session(ProbeEnv(), max_tool_calls=1)
    assert (await session.run_turn("<tool_call>{not json</tool_call>", None)) is not None and not session.stopped
    decision = await session.run_turn("<tool_call>{not json</tool_call>", None)
    assert decision is not None and decision.done and session.stopped == "max_tool_calls"

    # The session's turn cap is a backstop below the loop's own bound when configured so.
    session = await _session(ProbeEnv(), max_tool_calls=5)
    session.max_turns = 2
    assert (await session.run_turn("<tool_call>{not json</tool_call>", None)) is not None and not session.stopped
    await session.run_turn("<tool_call>{not json</tool_call>", None)
    assert session.stopped == "max_turns" and not session.loop.done


async def test_open_env_sessions_errors_and_group_task() -> None:
    with pytest.raises(InvalidArgument, match=r"known environments: .*sql-qa"):
        await open_env_sessions("nope", EnvHubConfig(), 1, None, None)
    with pytest.raises(FailedPrecondition, match=r"'sql-qa' could not be started: ToolError: database .* not exist"):
        await open_env_sessions("sql-qa", EnvHubConfig(sql_qa_db="/nonexistent.sqlite"), 1, None, None)
    with pytest.raises(InvalidArgument, match="no task 'nope'"):
        await open_env_sessions("sql-qa", EnvHubConfig(), 2, "nope", None)
    sessions = await open_env_sessions("sql-qa", EnvHubConfig(), 3, None, 5)
    try:
        assert len({s.task_id for s in sessions}) == 1 and len({id(s.env.loop.env) for s in sessions}) == 3
    finally:
        for s in sessions:
            await s.close()
    assert all(s.closed for s in sessions)
