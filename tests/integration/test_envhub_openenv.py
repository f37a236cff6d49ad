"""OpenEnv HTTP facade and client over a real HTTP server (acceptance point 6)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from engines.errors import FailedPrecondition, InvalidArgument
from envhub.config import SqlConfig
from envhub.connectors.sql import SqliteReadOnly
from envhub.envs._data import BUNDLED_DB, load_tasks
from envhub.envs.sql_qa import SqlQaEnv
from envhub.loop import ToolLoop
from envhub.openenv import OpenEnvClient, create_app
from envhub.types import FinalAnswer, ToolCall


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    """A real uvicorn server on a free port serving the sql-qa environment; yields its base URL."""
    shutil.copy(BUNDLED_DB, tmp_path / "db.sqlite")
    env = SqlQaEnv(SqliteReadOnly(tmp_path / "db.sqlite", SqlConfig()), load_tasks("sql_qa"))
    config = uvicorn.Config(create_app(env), host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws="none")
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(), name="openenv-test-server")
    async with asyncio.timeout(10):
        while not srv.started:  # noqa: ASYNC110 (uvicorn exposes no event for "listening")
            await asyncio.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, timeout=10)
        await env.close()


async def test_raw_http_round_trip(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, trust_env=False) as http:
        assert (await http.get("/health")).json() == {"status": "healthy"}
        schema = (await http.get("/schema")).json()
        assert set(schema) == {"action", "observation", "state"}
        assert schema["action"]["anyOf"][0]["properties"]["tool"] == {"const": "sql_query"}

        r = (await http.post("/reset", json={"task_id": "sql-1"})).json()
        assert r["done"] is False and r["reward"] is None
        assert r["observation"]["task_id"] == "sql-1"
        assert r["observation"]["messages"][-1] == {
            "role": "user",
            "content": "How many employees work in the Research department?",
            "name": "",
        }
        assert r["observation"]["tools"][0]["function"]["name"] == "sql_query"
        state = (await http.get("/state")).json()
        assert state["step_count"] == 0 and state["env_name"] == "sql-qa" and state["episode_id"]

        query = (
            "SELECT count(*) FROM employees e JOIN departments d ON d.id = e.department_id WHERE d.name = 'Research'"
        )
        r = (await http.post("/step", json={"action": {"tool": "sql_query", "arguments": {"query": query}}})).json()
        assert r["done"] is False and r["observation"]["messages"][0]["content"].splitlines()[1] == "3"
        r = await http.post("/step", json={"action": {"tool": "sql_query", "arguments": {"query": "DROP TABLE x"}}})
        assert r.status_code == 200 and r.json()["observation"]["is_error"] is True
        assert (await http.get("/state")).json()["step_count"] == 2

        r = (await http.post("/step", json={"action": {"answer": "<answer>3</answer>"}})).json()
        assert r == {"observation": {"messages": []}, "reward": 1.0, "done": True}
        state = (await http.get("/state")).json()
        assert state["done"] is True and state["reward"] == 1.0

        again = await http.post("/step", json={"action": {"answer": "3"}})
        assert again.status_code == 409 and again.json()["code"] == "FAILED_PRECONDITION"
        bad = await http.post("/step", json={"nope": 1})
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_ARGUMENT"
        assert (await http.post("/reset", json={"task_id": "missing"})).status_code == 400


async def test_openenv_client_connector_drives_the_tool_loop(server: str) -> None:
    env = OpenEnvClient(server)
    assert await env.health()
    opening = await env.reset(task_id="sql-2")
    assert [t.name for t in env.tools()] == ["sql_query"] and opening.task_id == "sql-2"
    loop = ToolLoop(env)
    d = await loop.on_turn(
        '<tool_call>{"name": "sql_query", "arguments": {"query": "SELECT name FROM employees ORDER BY salary DESC '
        'LIMIT 1"}}</tool_call>'
    )
    assert d.should_continue and d.observation[0].content == "name\nGrace Hopper"
    assert env.state().step_count == 1
    d = await loop.on_turn("<answer>Grace Hopper</answer>")
    assert d.done and d.reward == 1.0 and env.state().done
    with pytest.raises(FailedPrecondition):
        await env.step(FinalAnswer("again"))
    with pytest.raises(InvalidArgument):
        await env.reset(task_id="missing")
    await env.reset(seed=3)
    assert env.state().task_id == "sql-4" and not env.state().done
    r = await env.step(ToolCall("sql_query", {"query": "SELECT 1 AS one"}))
    assert r.observation[0].content == "one\n1" and not r.done
    await env.close()
