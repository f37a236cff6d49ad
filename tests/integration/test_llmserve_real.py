"""LLMServeEnv real mode: a static_workload episode through a real bridge on the embedded SmolLM2 engine.

Each window's requests are real streamed episodes through the bridge (``llmserve/real.py``); the
observations must come from what was measured (latencies, throughput), and the engine must have generated
exactly the tokens the observations count.
"""

from __future__ import annotations

import asyncio

import pytest

from llmserve.baselines import HeuristicAgent
from llmserve.env import LLMServeEnvironment
from llmserve.models import ServeAction
from llmserve.real import NOT_APPLIED
from llmserve.tasks import TASKS
from tests.conftest import StartBridge

pytestmark = pytest.mark.slow


async def test_static_workload_episode_through_the_bridge(
    start_bridge: StartBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = await start_bridge(engine={"type": "embedded", "embedded": {"max_model_len": 1024}})
    engine = server.bridge.engines[0]
    monkeypatch.setenv("LLMSERVE_MODE", "real")
    monkeypatch.setenv("LLMSERVE_BRIDGE", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("LLMSERVE_REAL_MAX_REQUESTS", "2")
    monkeypatch.setenv("LLMSERVE_REAL_OUTPUT_CAP", "4")
    env = LLMServeEnvironment()
    agent = HeuristicAgent()
    before = engine.counters.generated_tokens
    # The env steps synchronously (its requests run on a loop of its own): off this loop, which serves the bridge.
    obs = await asyncio.to_thread(env.reset, seed=0, task_id="static_workload")
    seen = []
    while not obs.done:
        action = agent.act(obs)
        obs = await asyncio.to_thread(env.step, action)
        seen.append(obs)
    await asyncio.to_thread(env.close)
    assert len(seen) == TASKS["static_workload"].episode_length and env.state.done
    assert all(o.metadata["mode"] == "real" and o.metadata["simulated"] == list(NOT_APPLIED) for o in seen)
    served = [o for o in seen if o.request_arrival_rate > 0]
    assert served, "no window had arrivals"
    for o in served:  # measured, not simulated: latencies and throughput from the streamed chunks
        assert o.p50_ttft_ms > 0 and o.throughput_tps > 0 and o.metadata["window_wall_s"] > 0
        assert 0.0 <= o.slo_compliance_rate <= 1.0
    tokens = sum(round(o.throughput_tps * o.metadata["window_wall_s"]) for o in seen)
    assert engine.counters.generated_tokens - before == tokens  # every counted token was sampled by the engine


def test_an_unknown_mode_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_MODE", "gpu")
    with pytest.raises(ValueError, match="'sim' or 'real'"):
        LLMServeEnvironment().reset(seed=0, task_id="static_workload")
    monkeypatch.setenv("LLMSERVE_MODE", "sim")
    obs = LLMServeEnvironment().reset(seed=0, task_id="static_workload")
    assert obs.done is False and ServeAction().batch_cap >= 1
