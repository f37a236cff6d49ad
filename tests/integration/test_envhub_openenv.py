"""The Env Hub on openenv-core: its server (HTTP, /ws, openenv validate --url) and the tool-loop client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from core.errors import FailedPrecondition, InvalidArgument
from envhub.config import SqlConfig
from envhub.connectors.sql import SqliteReadOnly
from envhub.envs._data import BUNDLED_DB, load_tasks
from envhub.envs.sql_qa import SqlQaEnv
from envhub.loop import ToolLoop
from envhub.openenv import HubAction, OpenEnvClient, _Wire, create_app
from envhub.types import FinalAnswer, ToolCall


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    """A real uvicorn server on a free port: openenv-core's app serving sql-qa (one env per session)."""
    shutil.copy(BUNDLED_DB, tmp_path / "db.sqlite")

    def factory() -> SqlQaEnv:
        return SqlQaEnv(SqliteReadOnly(tmp_path / "db.sqlite", SqlConfig()), load_tasks("sql_qa"))

    config = uvicorn.Config(create_app(factory, "sql-qa"), host="127.0.0.1", port=0, log_level="warning")
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


async def test_http_surface_and_errors(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, trust_env=False) as http:
        assert (await http.get("/health")).json()["status"] == "healthy"
        schema = (await http.get("/schema")).json()
        assert {"tool", "arguments", "answer"} <= set(schema["action"]["properties"])
        r = (await http.post("/reset", json={"task_id": "sql-1"})).json()  # stateless: a fresh env per request
        assert r["done"] is False and r["observation"]["task_id"] == "sql-1"
        assert r["observation"]["messages"][-1] == {
            "role": "user",
            "content": "How many employees work in the Research department?",
            "name": "",
        }
        assert r["observation"]["tools"][0]["function"]["name"] == "sql_query"
        unknown = await http.post("/reset", json={"task_id": "missing"})
        assert unknown.status_code == 400 and unknown.json()["code"] == "INVALID_ARGUMENT"
        early = await http.post("/step", json={"action": {"answer": "3"}})
        assert early.status_code == 409 and early.json()["code"] == "FAILED_PRECONDITION"
        both = await http.post("/step", json={"action": {"answer": "3", "tool": "sql_query"}})
        assert both.status_code == 400 and "exactly one" in both.json()["error"]
        for kind, value in (("object", {"a": 1}), ("array", [1])):  # openenv-core 0.3.0 alone answers 500
            typed = await http.post("/step", json={"action": {"answer": "3", "type": value}})
            assert typed.status_code == 422 and f"not a JSON {kind}" in typed.text
            assert typed.json()["detail"][0]["loc"] == ["body", "action", "type"]
        assert (await http.get("/health")).json()["status"] == "healthy"


async def test_ws_session_round_trip(server: str) -> None:
    """One stateful session over /ws with openenv-core's own client (the wire types of this module)."""
    async with _Wire(server) as wire:
        r = await wire.reset(task_id="sql-1")
        assert r.observation.task_id == "sql-1" and not r.done
        query = (
            "SELECT count(*) FROM employees e JOIN departments d ON d.id = e.department_id WHERE d.name = 'Research'"
        )
        r = await wire.step(HubAction(tool="sql_query", arguments={"query": query}))
        assert not r.done and r.observation.messages[0]["content"].splitlines()[1] == "3"
        r = await wire.step(HubAction(tool="sql_query", arguments={"query": "DROP TABLE x"}))
        assert r.observation.is_error is True and (await wire.state()).step_count == 2
        r = await wire.step(HubAction(answer="<answer>3</answer>"))
        assert r.done and r.reward == 1.0
        state = await wire.state()
        assert state.done and state.reward == 1.0 and state.env_name == "sql-qa"
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION"):
            await wire.step(HubAction(answer="3"))


async def test_openenv_validate_url_passes(server: str) -> None:
    out = await asyncio.to_thread(
        subprocess.run,
        [str(Path(sys.executable).parent / "openenv"), "validate", "--url", server],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] is True and not report["summary"]["failed_criteria"], report["summary"]


async def test_openenv_client_connector_drives_the_tool_loop(server: str) -> None:
    env = OpenEnvClient(server)
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
