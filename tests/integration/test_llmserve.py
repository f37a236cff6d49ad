"""LLMServeEnv over a real uvicorn server: openenv-core's client, isolation, determinism, validate."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from engines.launch import free_port
from llmserve.app import build_app
from llmserve.baselines import HeuristicAgent, RandomAgent
from llmserve.client import LLMServeEnv
from llmserve.models import ServeAction
from llmserve.tasks import TASKS


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


async def _episode(url: str, task_id: str, seed: int, agent_name: str) -> tuple[list[dict], list[float], dict]:
    agent = RandomAgent(seed) if agent_name == "random" else HeuristicAgent()
    env = LLMServeEnv.from_url(url)
    try:
        result = await env.reset(task_id=task_id, seed=seed)
        observations, rewards = [], []
        while not result.done:
            result = await env.step(agent.act(result.observation))
            observations.append(result.observation.model_dump())
            rewards.append(result.reward)
        state = await env.state()
        assert state.step_count == TASKS[task_id].episode_length and state.done
        graded = await env.grade()
        graded["log"] = state.episode_log.model_dump() if state.episode_log else None
        return observations, rewards, graded
    finally:
        await env.close()


@pytest.mark.parametrize("task_id", list(TASKS))
def test_full_episodes_over_ws_grade_in_unit_interval_and_replay(url: str, task_id: str) -> None:
    for agent in ("random", "heuristic"):
        obs, rewards, graded = asyncio.run(_episode(url, task_id, 3, agent))
        assert len(obs) == TASKS[task_id].episode_length
        assert 0.0 <= graded["score"] <= 1.0
        again = asyncio.run(_episode(url, task_id, 3, agent))
        assert again[0] == obs and again[1] == rewards and again[2]["score"] == graded["score"]  # bit-identical
        by_log = httpx.post(f"{url}/grader", json={"episode_log": graded["log"]}, timeout=30).json()
        assert by_log["score"] == graded["score"] and by_log["episode_return"] == graded["episode_return"]


def test_eight_concurrent_sessions_are_isolated(url: str) -> None:
    async def main() -> list[tuple[list[dict], list[float], dict]]:
        return await asyncio.gather(*(_episode(url, "static_workload", s % 4, "random") for s in range(8)))

    results = asyncio.run(main())
    for i in range(4):  # same seed -> identical; different seeds -> different
        assert results[i][0] == results[i + 4][0]
        assert results[i][0] != results[(i + 1) % 4][0]
    solo = asyncio.run(_episode(url, "static_workload", 1, "random"))
    assert solo[0] == results[1][0]


def _ws_roundtrip(url: str, messages: list[dict]) -> list[dict]:
    from websockets.sync.client import connect

    out = []
    with connect(url.replace("http://", "ws://") + "/ws") as ws:
        for m in messages:
            ws.send(json.dumps(m))
            out.append(json.loads(ws.recv()))
    return out


def test_bad_input_names_field_and_range_and_changes_nothing(url: str) -> None:
    resp = httpx.post(f"{url}/step", json={"action": {"batch_cap": 600}}, timeout=10)
    assert resp.status_code == 422 and "batch_cap must be an integer in 1..512" in resp.text
    resp = httpx.post(f"{url}/step", json={"action": {"warp_drive": 1}}, timeout=10)
    assert resp.status_code == 422 and "warp_drive" in resp.text
    resp = httpx.post(f"{url}/step", json={"action": {"batch_cap": 8, "type": {"x": []}}}, timeout=10)
    assert resp.status_code == 422 and "action.type must be a string" in resp.text  # not openenv-core's 500
    resp = httpx.post(f"{url}/reset", json={"task_id": "nope"}, timeout=10)
    assert resp.status_code == 422 and all(t in resp.text for t in TASKS)
    good = ServeAction(batch_cap=32).model_dump(mode="json", exclude={"metadata"})
    replies = _ws_roundtrip(
        url,
        [
            {"type": "reset", "data": {"task_id": "static_workload", "seed": 5}},
            {"type": "step", "data": {**good, "kv_budget_fraction": 2.0}},
            {"type": "state"},
            {"type": "step", "data": good},
        ],
    )
    assert replies[1]["type"] == "error" and "kv_budget_fraction must be a number in 0.1..1" in json.dumps(replies[1])
    assert replies[2]["data"]["step_count"] == 0
    clean = _ws_roundtrip(url, [{"type": "reset", "data": {"task_id": "static_workload", "seed": 5}},
                                {"type": "step", "data": good}])  # fmt: skip
    assert replies[3] == clean[1]
    unknown = _ws_roundtrip(url, [{"type": "reset", "data": {"task_id": "nope"}}])[0]
    assert unknown["type"] == "error" and "bursty_workload" in unknown["data"]["message"]
    n = TASKS["static_workload"].episode_length
    msgs = [{"type": "reset", "data": {"task_id": "static_workload", "seed": 0}}] + [{"type": "step", "data": good}] * (
        n + 1
    )
    last = _ws_roundtrip(url, msgs)[-1]
    assert last["type"] == "error" and "is finished" in last["data"]["message"]


def test_tasks_and_baseline_routes(url: str) -> None:
    tasks = httpx.get(f"{url}/tasks", timeout=10).json()
    assert [t["task_id"] for t in tasks["tasks"]] == list(TASKS)
    rows = httpx.get(f"{url}/baseline", timeout=60).json()["baseline"]
    assert len(rows) == 6 and all(0.0 <= s <= 1.0 for r in rows for s in r["scores"])


def test_openenv_validate_url_passes(url: str) -> None:
    cli = Path(sys.executable).parent / "openenv"
    proc = subprocess.run([str(cli), "validate", "--url", url, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert all(c["passed"] for c in report["criteria"]), report
