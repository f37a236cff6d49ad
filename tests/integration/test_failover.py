"""Replica failure: a replica that dies mid-turn leaves rotation, the episode continues on another replica
with its exact history, health checks take replicas out and bring them back, gRPC health follows.

Two SGLang stand-in servers (real HTTP, the documented wire format) backed by two identical toy engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.types import ModelFacts
from engines.config import SglangConfig, ToyConfig
from engines.http.sglang import SglangEngine
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient
from rl_client.errors import UnavailableError
from server.app import create_server
from server.config import load_settings
from tests.integration.engine_script import bridge_over
from tests.standins._common import StandinServer
from tests.standins.sglang import SglangStandin

PROMPT = [1, 4, 30, 31, 32, 2, 5]


def _adapter(url: str, toy: ToyEngine, replica: str) -> SglangEngine:
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    config = SglangConfig.model_validate({"connect_retries": 0, "control_timeout_s": 1.0})
    return SglangEngine(url, config, facts, model="toy", tokenizer=toy.tokenizer, request_timeout_s=30, replica=replica)


@pytest.fixture
async def replicas() -> AsyncIterator[list[tuple[SglangStandin, StandinServer, ToyEngine]]]:
    out = []
    for _ in range(2):
        toy = ToyEngine(ToyConfig(yield_every=3))  # same seed: the same model on both replicas
        sg = SglangStandin(toy, served_model_name="toy")
        out.append((sg, await sg.serve(), toy))
    yield out
    for _, server, _ in out:
        await server.stop()


async def _status(port: int, service: str = "") -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_replica_dying_mid_turn_moves_the_episode_with_its_exact_history(replicas: Any) -> None:
    engines = [_adapter(server.url, toy, f"r{i}") for i, (_, server, toy) in enumerate(replicas)]
    async with bridge_over(engines) as (bridge_server, client):
        sampling = {"max_tokens": 40, "ignore_eos": True, "seed": 3}
        ep = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
        home = bridge_server.bridge.store.get(ep, "").replica
        sg, _, _ = replicas[home]
        sg.faults.drop_after_tokens = 5  # the engine process goes away mid-stream
        with pytest.raises(UnavailableError, match="dropped the stream"):
            await client.step(ep)
        assert bridge_server.bridge.router.replicas.healthy[home] is False  # out of rotation at once

        other = 1 - home
        prefill_before = replicas[other][2].counters.prefill_tokens
        turn = await client.step(ep, [9, 10])  # continues on the healthy replica
        assert bridge_server.bridge.store.get(ep, "").replica == other
        traj = await client.end_episode(ep)
        first, second = traj.turns
        assert first.finish_reason == "abort" and 0 < first.end - first.generation_start < 40
        # The new replica was sent the exact history: prompt + the partial turn + the observation.
        assert replicas[other][2].counters.prefill_tokens - prefill_before == second.generation_start
        assert traj.token_ids[: second.generation_start].tolist()[-2:] == [9, 10]
        assert traj.token_ids[second.generation_start :].tolist() == turn.token_ids.tolist()
        # New episodes avoid the failed replica until a health check passes again.
        new = (await client.start_episode(PROMPT)).episode_id
        assert bridge_server.bridge.store.get(new, "").replica == other


async def test_health_checks_rotate_replicas_and_drive_grpc_health(replicas: Any) -> None:
    engines = [_adapter(server.url, toy, f"r{i}") for i, (_, server, toy) in enumerate(replicas)]
    async with bridge_over(engines) as (bridge_server, client):
        assert await _status(bridge_server.port) == health_pb2.HealthCheckResponse.SERVING
        replicas[0][0].faults.unhealthy = True
        assert await bridge_server.check_health()
        assert bridge_server.bridge.router.replicas.healthy == [False, True]
        assert await _status(bridge_server.port) == health_pb2.HealthCheckResponse.SERVING
        replicas[1][0].faults.unhealthy = True
        assert not await bridge_server.check_health()
        assert await _status(bridge_server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        replicas[0][0].faults.unhealthy = False
        assert await bridge_server.check_health()
        assert bridge_server.bridge.router.replicas.healthy == [True, False]
        assert await _status(bridge_server.port) == health_pb2.HealthCheckResponse.SERVING
        ep = (await client.start_episode(PROMPT)).episode_id
        assert bridge_server.bridge.store.get(ep, "").replica == 0


async def test_a_client_waits_for_serving_through_the_first_health_check(replicas: Any) -> None:
    """From the moment the port serves until the first health check has answered, gRPC health says NOT_SERVING,
    for the server ("": the health service's default was SERVING, so a probe sent traffic to engines nobody had
    checked) and for primerl.v1.PrimeRL (was NOT_FOUND, so ``wait_until_ready`` failed at once)."""
    for sg, _, _ in replicas:
        sg.faults.health_delay_s = 0.6  # the engines are still loading (the adapters give /health 1 s)
    engines = [_adapter(server.url, toy, f"r{i}") for i, (_, server, toy) in enumerate(replicas)]
    settings = load_settings(server={"port": 0, "grace_period_s": 0.5}, metrics={"port": 0})
    bridge_server = await create_server(settings, engines=engines)
    starting = asyncio.create_task(bridge_server.start())
    client = AsyncBridgeClient(f"127.0.0.1:{bridge_server.port}")
    try:
        status = None
        for _ in range(1000):  # the first answer, as soon as the port serves (UNAVAILABLE until then)
            try:
                status = await _status(bridge_server.port)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or starting.done():
                    raise
                await asyncio.sleep(0.01)
        named = await _status(bridge_server.port, "primerl.v1.PrimeRL")
        assert status == named == health_pb2.HealthCheckResponse.NOT_SERVING and not starting.done()
        await client.wait_until_ready(30)
        assert starting.done() and await _status(bridge_server.port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await starting
        await client.close()
        await bridge_server.stop(0.5)


async def test_an_engine_failure_reaches_an_http_client_as_a_503_with_openai_error_json(replicas: Any) -> None:
    """The HTTP front door maps the same failure (UNAVAILABLE) to 503 and OpenAI's error JSON; the partial
    tokens stay in the session."""
    import httpx

    from engines.launch import free_port

    engines = [_adapter(server.url, toy, f"r{i}") for i, (_, server, toy) in enumerate(replicas)]
    async with bridge_over(engines, http={"port": free_port()}) as (bridge_server, _):
        base = f"http://127.0.0.1:{bridge_server.http_port}"
        gen = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 40, "ignore_eos": True, "seed": 3}}
        for sg, _, _ in replicas:
            sg.faults.drop_after_tokens = 5  # whichever replica the session lands on goes away mid-stream
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            r = await http.post("/inference/v1/generate", json=gen, headers={"X-Session-ID": "s"})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == 503 and err["type"] == "service_unavailable_error" and "dropped" in err["message"]
            for sg, _, _ in replicas:
                sg.faults.drop_after_tokens = None
            trajectory = (await http.get("/v1/sessions/s/trajectory")).json()
            assert trajectory["token_ids"][: len(PROMPT)] == PROMPT and len(trajectory["token_ids"]) > len(PROMPT)
