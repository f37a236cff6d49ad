"""The env hub's tool loop on the bridge: StartEpisode(env=...) -> Step runs tool calls server-side -> EndEpisode.

Fast tests run the toy engine (its word-level model writes no tool calls, so its episodes end after one
graded turn) and cover validation, grading, rewards and closing. The slow ones run SmolLM2-135M on the
embedded engine through a real multi-turn loop on the ``sql-qa`` environment: a task makes the model copy
a tool call, the bridge runs it against the bundled read-only SQLite database, appends the result as env
tokens and samples again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import envhub.registry
from core.toolcall import strip_end_markers, strip_tool_calls
from core.types import Message
from envhub.config import EnvHubConfig
from envhub.connectors.sql import SqliteReadOnly
from envhub.envs import sql_qa
from envhub.envs._data import BUNDLED_DB
from envhub.graders import grade_exact
from envhub.loop import start_env_episode
from envhub.rewards import extract_answer
from rl_client import AsyncBridgeClient, Trajectory
from rl_client.errors import FailedPreconditionError, InvalidArgumentError
from server.app import BridgeServer, create_server
from server.config import load_settings
from tests.conftest import StartBridge

MAX_MODEL_LEN = 1024
MAX_TOOL_CALLS = 2


def _copy(query: str) -> tuple[str, str]:
    """A task that makes SmolLM2-135M-Instruct (greedy, under sql-qa's system prompt) call ``query``: (call, question).

    It copies the call verbatim followed by <|im_end|>; without the question's trailing newline it writes prose.
    """
    call = "<tool_call>" + json.dumps({"name": "sql_query", "arguments": {"query": query}}) + "</tool_call>"
    return call, "Copy this line exactly and write nothing else:\n" + call + "\n"


# After this call's result the model answers in prose (about MySQL): two turns, graded as the final answer.
# The reference is a word of that answer, so the grader's value is not 0 (0.5: the reference among other words).
ANSWER_QUERY = "SELECT name FROM employees ORDER BY salary DESC LIMIT 1"
ANSWER_CALL, ANSWER_QUESTION = _copy(ANSWER_QUERY)
ANSWER_REFERENCE = "MySQL"
# After this call's result the model copies the call again, every turn: the tool-call bound ends the loop.
LOOP_QUERY = "SELECT COUNT(*) FROM employees"
LOOP_CALL, LOOP_QUESTION = _copy(LOOP_QUERY)


def _tasks_dir(path: Path, *tasks: tuple[str, str, str]) -> str:
    """A tasks directory holding ``sql_qa.json`` with (task_id, question, reference) rows."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"task_id": t, "question": q, "reference": r} for t, q, r in tasks]
    (path / "sql_qa.json").write_text(json.dumps(rows))
    return str(path)


def _grade(text: str, reference: str) -> float:
    """The sql-qa grader applied to a turn's text, independently of the bridge."""
    return grade_exact(extract_answer(strip_end_markers(text))[0], reference)


class _Counting:
    """A factory for the real sql-qa environment that counts opened and closed instances."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    def __call__(self, config: EnvHubConfig) -> sql_qa.SqlQaEnv:
        env = sql_qa.make(config)
        self.opened += 1
        close = env.close

        async def counted_close() -> None:
            self.closed += 1
            await close()

        env.close = counted_close  # type: ignore[method-assign]
        return env


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    factory = _Counting()
    monkeypatch.setitem(envhub.registry._FACTORIES, "sql-qa-counted", factory)
    return factory


# -- toy engine: validation, grading, rewards, closing -------------------------------------------------------------


async def test_unknown_env_is_invalid_argument_and_lists_the_known_ones(start_bridge: StartBridge) -> None:
    server, client = await start_bridge()
    with pytest.raises(InvalidArgumentError) as err:
        await client.start_episode(env="no-such-env")
    assert "no-such-env" in err.value.details
    for name in envhub.registry.names():
        assert name in err.value.details
    assert len(server.bridge.store) == 0


async def test_env_supplies_prompt_and_tools_and_bad_requests_are_refused(
    start_bridge: StartBridge, tmp_path: Path
) -> None:
    server, client = await start_bridge()
    with pytest.raises(InvalidArgumentError, match="supplies the prompt"):
        await client.start_episode([{"role": "user", "content": "hi"}], env="sql-qa")
    with pytest.raises(InvalidArgumentError, match="supplies the prompt"):
        await client.start_episode(env="sql-qa", tools=[{"type": "function", "function": {"name": "x"}}])
    with pytest.raises(InvalidArgumentError, match="no task 'nope'"):
        await client.start_episode(env="sql-qa", env_task_id="nope")
    assert len(server.bridge.store) == 0

    # A broken environment setup (no tasks file) is a clear FAILED_PRECONDITION, not INTERNAL.
    _, broken = await start_bridge(envhub={"tasks_dir": str(tmp_path / "missing")})
    with pytest.raises(FailedPreconditionError, match="environment 'sql-qa' could not be started"):
        await broken.start_episode(env="sql-qa")

    # The task is picked by env_seed when no task id is given, and reported back.
    started = await client.start_episode(env="sql-qa", env_seed=1, sampling={"max_tokens": 4})
    assert started.env_task_id == "sql-2"
    with pytest.raises(InvalidArgumentError, match="send no observation"):
        await client.step(started.episode_id, [{"role": "user", "content": "more"}])
    traj = await client.end_episode(started.episode_id)
    assert traj.metadata["env.task_id"] == "sql-2" and traj.metadata["env.reason"] == "open"
    assert traj.rewards == [] and len(traj.turns) == 0


async def test_toy_episode_is_graded_and_the_grader_reward_is_the_trajectory_reward(
    start_bridge: StartBridge, tmp_path: Path, counting: _Counting
) -> None:
    reference = "the"
    tasks = _tasks_dir(tmp_path / "tasks", ("copy-1", "Say the word the", reference))
    server, client = await start_bridge(envhub={"tasks_dir": tasks})
    started = await client.start_episode(
        env="sql-qa-counted", group_size=2, sampling={"temperature": 0.8, "seed": 3, "max_tokens": 12}
    )
    assert counting.opened == 2 and started.env_task_id == "copy-1"
    first, second = started.episode_ids

    turn = await client.step(first)
    assert turn.env is not None and turn.env.done and turn.env.reason == "final_answer"
    assert turn.env.turns == 1 and turn.env.tool_calls == 0 and not turn.env.truncated
    assert set(turn.origins) == {"sampled"}  # no tool call: one turn, nothing from the environment
    assert turn.env.reward == pytest.approx(_grade(turn.text, reference))
    with pytest.raises(FailedPreconditionError, match="already graded"):
        await client.step(first)

    traj = await client.end_episode(first)
    assert traj.rewards == [pytest.approx(turn.env.reward)]  # the grader's, as the client sent none
    assert traj.metadata["env.name"] == "sql-qa-counted" and traj.metadata["env.reason"] == "final_answer"
    assert traj.metadata["env.done"] == "true" and float(traj.metadata["env.reward"]) == pytest.approx(turn.env.reward)

    await client.step(second)
    traj = await client.end_episode(second, reward=0.25)
    assert traj.rewards == [0.25]  # a trainer's own reward wins over the grader's
    assert counting.closed == 2
    assert len(server.bridge.store) == 0


async def test_envs_are_closed_on_discard_and_on_shutdown(tmp_path: Path, counting: _Counting) -> None:
    settings = load_settings(engine={"type": "toy"}, server={"port": 0}, metrics={"port": 0})
    server = await create_server(settings)
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30)
    try:
        discarded = await client.start_episode(env="sql-qa-counted")
        await client.discard_episode(discarded.episode_id)
        assert counting.closed == 1
        await client.start_episode(env="sql-qa-counted", group_size=3)
        assert counting.opened == 4 and counting.closed == 1
    finally:
        await client.close()  # frees the client's open episodes: their environments close
        await server.stop(0.5)
    assert counting.closed == 4

    server = await create_server(settings)
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30)
    await client.start_episode(env="sql-qa-counted", group_size=2)
    client.open_episodes.clear()  # a trainer that vanished: the server's shutdown must close them
    await client.close()
    await server.stop(0.5)
    assert counting.opened == 6 and counting.closed == 6


# -- SmolLM2-135M on the embedded engine: a real multi-turn tool loop ------------------------------------------

Bridge = tuple[BridgeServer, AsyncBridgeClient]
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smollm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bridge]:
    pytest.importorskip("torch")
    tasks = _tasks_dir(
        tmp_path_factory.mktemp("envhub") / "tasks",
        ("answer", ANSWER_QUESTION, ANSWER_REFERENCE),
        ("loop", LOOP_QUESTION, "10"),
    )
    settings = load_settings(
        engine={"type": "embedded", "embedded": {"max_model_len": MAX_MODEL_LEN}},
        server={"port": 0, "grace_period_s": 1.0},
        metrics={"port": 0},
        envhub={"tasks_dir": tasks, "loop": {"max_tool_calls": MAX_TOOL_CALLS}},
    )
    server = await create_server(settings)
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=600)
    yield server, client
    await client.close()
    await server.stop(0.5)


async def _sql(query: str) -> str:
    """What the sql_query tool returns for ``query``, computed without the bridge or the environment."""
    db = SqliteReadOnly(BUNDLED_DB)
    try:
        return await db.query(query)
    finally:
        db.close()


def _check_tiling(traj: Trajectory, tok: Any, tool_result: str) -> list[str]:
    """Turns tile the arrays (prompt, turn 0, then tool result + turn ...); returns each model message's text.

    Sampled tokens: origin sampled, mask 1, finite logprob. Env tokens: origin env, mask 0, NaN logprob, and
    exactly the chat rendering of the tool's result after the history. A turn after an aborted one continues
    the same model message (no env tokens between them).
    """
    messages: list[str] = []
    end = traj.prompt_length
    for i, t in enumerate(traj.turns):
        assert t.observation_start == end and t.end >= t.generation_start
        env, sampled = slice(t.observation_start, t.generation_start), slice(t.generation_start, t.end)
        continues = i > 0 and traj.turns[i - 1].finish_reason == "abort"
        assert (t.generation_start > t.observation_start) == (i > 0 and not continues)
        assert (traj.origins[env] == 2).all() and not traj.loss_mask[env].any() and np.isnan(traj.logprobs[env]).all()
        assert (traj.origins[sampled] == 3).all() and traj.loss_mask[sampled].all()
        assert np.isfinite(traj.logprobs[sampled]).all()
        if t.generation_start > t.observation_start:
            history = traj.token_ids[: t.observation_start].tolist()
            rendered = tok.render_continuation([Message("tool", tool_result, "sql_query")], history)
            assert traj.token_ids[env].tolist() == rendered
        text = tok.decode(traj.token_ids[sampled].tolist())
        if continues:
            messages[-1] += text
        else:
            messages.append(text)
        end = t.end
    assert end == len(traj)
    return messages


def _reference_logprobs(ids: list[int]) -> Any:
    """Log-softmax of an independently loaded transformers model over the whole sequence (float64)."""
    import torch

    from engines.model_store import ensure_converted, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ensure_converted())
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.slow
async def test_multi_turn_episode_masks_env_tokens_and_takes_the_grader_reward(smollm: Bridge) -> None:
    server, client = smollm
    tok = server.bridge.tokenizer
    assert tok is not None
    started = await client.start_episode(env="sql-qa", env_task_id="answer", sampling=GREEDY)
    chunks = [c async for c in client.stream_step(started.episode_id)]
    traj = await client.end_episode(started.episode_id)  # no reward sent: the grader's is the trajectory's
    done = chunks[-1].done
    assert done is not None and done.env is not None and all(c.done is None for c in chunks[:-1])

    # The prompt is the environment's opening rendered with its tool schemas.
    env = await start_env_episode("sql-qa", server.settings.envhub, task_id="answer")
    try:
        prompt = tok.render_prompt(env.prompt_messages, env.tool_schemas)
    finally:
        await env.close()
    assert traj.prompt_length == started.prompt_tokens == len(prompt)
    assert traj.token_ids[: traj.prompt_length].tolist() == prompt

    # Every token after the prompt reached the client in order, with its origin.
    assert traj.token_ids[traj.prompt_length :].tolist() == [t for c in chunks for t in c.token_ids]
    assert traj.origin_names()[traj.prompt_length :] == [o for c in chunks for o in c.origins]

    # Turn 0 called the tool; its result follows as env tokens; turn 1 answered without a call.
    messages = _check_tiling(traj, tok, await _sql(ANSWER_QUERY))
    assert len(traj.turns) == 2 and traj.turns[0].finish_reason == "stop"
    assert strip_end_markers(messages[0]) == ANSWER_CALL and "<tool_call>" not in messages[1]
    assert done.turn_index == 1 and done.text == messages[1]
    assert done.env.done and done.env.reason == "final_answer" and not done.env.truncated
    assert done.env.tool_calls == 1 and done.env.turns == 2

    # The engine saw exactly these ids: each sampled token is the greedy choice of an independent model over
    # the whole trajectory, with the same logprob.
    logp = _reference_logprobs(traj.token_ids.tolist())
    positions = np.flatnonzero(traj.loss_mask)
    assert (logp[positions - 1].argmax(axis=-1) == traj.token_ids[positions]).all()
    np.testing.assert_allclose(traj.logprobs[positions], logp[positions - 1, traj.token_ids[positions]], atol=2e-3)

    # The reward is the grader's value on the final answer.
    expected = _grade(messages[1], ANSWER_REFERENCE)
    assert expected > 0  # the task still exercises the grader (see ANSWER_REFERENCE)
    assert done.env.reward == pytest.approx(expected) and traj.rewards == [pytest.approx(expected)]
    assert traj.metadata["env.reason"] == "final_answer" and traj.metadata["env.tool_calls"] == "1"
    assert traj.metadata["env.task_id"] == "answer" and float(traj.metadata["env.reward"]) == pytest.approx(expected)


@pytest.mark.slow
async def test_bounded_loop_stops_and_a_cancel_mid_loop_keeps_the_episode_consistent(smollm: Bridge) -> None:
    server, client = smollm
    tok = server.bridge.tokenizer
    episode_id = (await client.start_episode(env="sql-qa", env_task_id="loop", sampling=GREEDY)).episode_id
    async with contextlib.aclosing(client.stream_step(episode_id)) as stream:
        async for chunk in stream:
            if "env" in chunk.origins:
                break  # the first tool result arrived: the bridge is sampling the next turn; cancel the Step
    turn = None
    for _ in range(400):  # the bridge finishes cancelling the Step (closing its turn) asynchronously
        try:
            turn = await client.step(episode_id)
            break
        except FailedPreconditionError as err:
            assert "in progress" in err.details
            await asyncio.sleep(0.05)
    assert turn is not None and turn.env is not None

    # The model repeats the call; after MAX_TOOL_CALLS calls the bound grades the turn with its calls stripped.
    assert turn.env.done and turn.env.reason == "max_tool_calls" and turn.env.truncated
    assert turn.env.tool_calls == MAX_TOOL_CALLS
    with pytest.raises(FailedPreconditionError, match="already graded"):
        await client.step(episode_id)
    traj = await client.end_episode(episode_id)

    # The cut turn was continued, not re-sampled: MAX_TOOL_CALLS + 1 model messages, each the call, with the
    # tool's result between them; each call ran once.
    messages = _check_tiling(traj, tok, await _sql(LOOP_QUERY))
    assert [strip_end_markers(m) for m in messages] == [LOOP_CALL] * (MAX_TOOL_CALLS + 1)
    aborted = sum(t.finish_reason == "abort" for t in traj.turns)
    assert len(traj.turns) == MAX_TOOL_CALLS + 1 + aborted
    expected = _grade(strip_tool_calls(strip_end_markers(messages[-1])), "10")
    assert traj.rewards == [pytest.approx(expected)] and turn.env.reward == pytest.approx(expected)
    assert traj.metadata["env.tool_calls"] == str(MAX_TOOL_CALLS) and traj.metadata["env.truncated"] == "true"
    assert len(server.bridge.store) == 0
