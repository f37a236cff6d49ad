"""The llm agent of LLMServeEnv through the official ``openai`` SDK against real servers on free ports.

A real bridge's HTTP front door (toy engine: its replies are never JSON, so every window falls back to
the heuristic) and a stand-in chat server speaking OpenAI's wire format that answers a valid action on
even windows and prose on odd ones. What a user would notice: the episode completes and grades in
[0, 1], every window is either parsed or fell back, the fallback is the heuristic's action, the
requests are temperature 0 with a token bound, and ``/baseline?use_openai=true`` returns the llm rows,
or a 400 (not set up) / 502 (endpoint down) naming ``OPENAI_BASE_URL`` instead of a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines.launch import free_port
from llmserve.app import BASELINE_SEEDS, build_app
from llmserve.baselines import HeuristicAgent
from llmserve.episode import Episode
from llmserve.grader import grade, run_agent
from llmserve.llm import MAX_TOKENS, LLMAgent, LLMConfig, LLMEndpointError, LLMStats
from llmserve.models import ServeAction, action_fields
from llmserve.tasks import TASKS, get_task
from server.app import BridgeServer
from server.cli import main
from tests.conftest import StartBridge
from tests.standins._common import StandinServer

TASK = "static_workload"
STANDIN_ACTION = {"batch_cap": 24, "kv_budget_fraction": 0.75, "speculation_depth": 2, "quantization_tier": "INT8",
                  "prefill_decode_split": False, "priority_routing": True}  # fmt: skip


@pytest.fixture
async def front_door(start_bridge: StartBridge) -> AsyncIterator[tuple[BridgeServer, str]]:
    """A toy-engine bridge with its HTTP front door on a free port; its OpenAI API root."""
    server, _ = await start_bridge(http={"port": free_port()})
    yield server, f"http://127.0.0.1:{server.http_port}/v1"


def _standin_app(requests: list[dict[str, Any]]) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model", "created": 0,
                                                          "owned_by": "tests"}]})  # fmt: skip

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        requests.append(body)
        window = int(body["messages"][-1]["content"].split("window ")[1].split(".")[0])
        text = f"Sure:\n```json\n{json.dumps(STANDIN_ACTION)}\n```" if window % 2 == 0 else "I would batch more."
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )  # fmt: skip

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture
async def standin() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A chat server on a free port (real uvicorn, on this loop) that records the requests it answers."""
    requests: list[dict[str, Any]] = []
    server = StandinServer(_standin_app(requests))
    url = await server.start()
    yield f"{url}/v1", requests
    await server.stop()


async def test_episode_against_the_bridge_front_door_falls_back_on_every_unparsable_reply(
    front_door: tuple[BridgeServer, str],
) -> None:
    server, base_url = front_door
    engine = server.bridge.engines[0]
    before = engine.counters.requests
    agent = await asyncio.to_thread(LLMAgent, LLMConfig(base_url=base_url))  # the SDK is sync: off the bridge's loop
    log = await asyncio.to_thread(run_agent, agent, TASK, 0)
    windows = TASKS[TASK].episode_length
    assert agent.model == "toy" and engine.counters.requests - before == windows  # one chat call per window
    assert 0.0 <= grade(log).score <= 1.0
    s = agent.stats
    assert s.windows == windows and s.parsed + s.fell_back == windows
    assert s.parsed == 0  # the toy engine writes token noise, never a JSON action
    assert log.actions == run_agent(HeuristicAgent(), TASK, 0).actions  # the documented fallback
    assert all(ServeAction.model_validate(a) for a in log.actions)


async def test_parsed_replies_are_acted_on_and_requests_are_bounded(
    standin: tuple[str, list[dict[str, Any]]],
) -> None:
    base_url, requests = standin
    agent = await asyncio.to_thread(LLMAgent, LLMConfig(base_url=base_url))
    log = await asyncio.to_thread(run_agent, agent, TASK, 1)
    windows = TASKS[TASK].episode_length
    assert agent.stats.summary() == f"llm: {windows} windows, 16 parsed, 16 fell back to the heuristic"
    ep = Episode(get_task(TASK), 1)
    obs = ep.initial_observation()
    for i, action in enumerate(log.actions):  # even windows: the stand-in's action; odd: the heuristic's
        assert action == (STANDIN_ACTION if i % 2 == 0 else action_fields(HeuristicAgent().act(obs)))
        obs = ep.step(ServeAction.model_validate(action))
    assert 0.0 <= grade(log).score <= 1.0
    assert len(requests) == windows and agent.model == "standin"
    assert all(r["temperature"] == 0 and r["max_tokens"] == MAX_TOKENS and r["model"] == "standin" for r in requests)


async def test_cli_evaluate_prints_the_llm_counts(
    standin: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", standin[0])
    monkeypatch.delenv("OPENAI_MODEL", raising=False)
    argv = ["llmserve", "evaluate", "--agent", "llm", "--agent", "heuristic", "--task", TASK, "--episodes", "2"]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    windows = 2 * TASKS[TASK].episode_length
    assert f"| {TASK} | llm |" in out and f"| {TASK} | heuristic |" in out
    assert f"{TASK}: {LLMStats(windows, windows // 2, windows // 2).summary()} (model standin)" in out


def test_unreachable_endpoint_is_a_clear_error() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(LLMEndpointError, match=re.escape(f"OPENAI_BASE_URL={dead}: the endpoint failed")):
        LLMAgent(LLMConfig(base_url=dead, timeout_s=5))


async def test_baseline_use_openai_returns_llm_rows_400_without_the_variable_502_when_down(
    front_door: tuple[BridgeServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, base_url = front_door
    transport = httpx.ASGITransport(app=build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://llmserve", timeout=300) as http:
        monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
        r = await http.get("/baseline", params={"use_openai": "true"})
        assert r.status_code == 400 and "OPENAI_BASE_URL" in r.json()["detail"]
        dead = f"http://127.0.0.1:{free_port()}/v1"
        monkeypatch.setenv("OPENAI_BASE_URL", dead)
        r = await http.get("/baseline", params={"use_openai": "true"})
        assert r.status_code == 502 and f"OPENAI_BASE_URL={dead}: the endpoint failed" in r.json()["detail"]
        plain = (await http.get("/baseline")).json()["baseline"]
        assert {row["agent"] for row in plain} == {"random", "heuristic"}  # the deterministic suite, unchanged

        monkeypatch.setenv("OPENAI_BASE_URL", base_url)
        monkeypatch.delenv("OPENAI_MODEL", raising=False)
        r = await http.get("/baseline", params={"use_openai": "true"})
        assert r.status_code == 200, r.text
        rows = r.json()["baseline"]
        assert rows[: len(plain)] == plain
        llm = [row for row in rows if row["agent"] == "llm"]
        assert [row["task_id"] for row in llm] == list(TASKS)
        for row in llm:
            assert row["model"] == "toy" and all(0.0 <= s <= 1.0 for s in row["scores"])
            assert row["windows"] == TASKS[row["task_id"]].episode_length * len(BASELINE_SEEDS)
            assert row["parsed"] + row["fell_back"] == row["windows"]
            assert row["summary"] == LLMStats(row["windows"], row["parsed"], row["fell_back"]).summary()
