"""What operators and generic gRPC tools see: health, reflection, CLI start-up."""

from __future__ import annotations

import asyncio
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engines.launch import free_port
from rl_client import AsyncBridgeClient
from server.app import BridgeServer

Bridge = tuple[BridgeServer, AsyncBridgeClient]


async def test_health_serving_and_reflection(bridge: Bridge) -> None:
    server, _ = bridge
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "primerl.v1.PrimeRL"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in call for s in r.list_services_response.service}
    assert {"primerl.v1.PrimeRL", "grpc.health.v1.Health"} <= names


async def test_cli_serves_and_stops_gracefully_on_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    config = tmp_path / "bridge.toml"
    config.write_text('[engine]\ntype = "toy"\n[engine.toy]\nseed = 3\n[server]\nport = 1\n')
    env = {**os.environ, "PRIMERL_SERVER__PORT": "2"}  # env beats the file, the flag beats both
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "server",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--metrics-port",
        "0",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=30)
        await client.wait_until_ready(timeout=60)
        info = await client.server_info()
        assert info.models[0].engine == "toy"
        await client.close()
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        assert b"shutting down" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_rejects_bad_config_with_a_clear_message(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "bad.toml"
    config.write_text("[admission]\nmax_episodes = 0\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server", "serve", "--config", str(config), stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"invalid configuration" in err and b"max_episodes" in err


async def test_cli_refuses_an_engine_it_cannot_start() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server", "serve", "--engine", "trtllm", "--port", "0", stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"cannot start the bridge" in err and b"trtllm" in err and b"Traceback" not in err
