"""OpenTelemetry spans of a real episode (in-memory exporter), and tracing off by default."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.toy import ToyEngine
from observability.tracing import TracedEngine, Tracing, tracing_requested
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from server.app import BridgeServer, create_server
from server.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
SERVICE = "primerl.v1.PrimeRL"


@pytest.fixture
async def traced() -> AsyncIterator[tuple[BridgeServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = load_settings(engine={"type": "toy"}, server={"port": 0, "grace_period_s": 1.0}, metrics={"port": 0})
    server = await create_server(settings, tracing=Tracing(provider))
    await server.start()
    try:
        yield server, exporter
    finally:
        await server.stop(0.5)
        provider.shutdown()


async def test_one_span_per_rpc_with_child_engine_spans_and_the_episode_id(traced) -> None:  # type: ignore[no-untyped-def]
    server, exporter = traced
    sampling = pb.SamplingParams(max_tokens=6, ignore_eos=True, seed=3)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.PrimeRLStub(channel)
        started = await stub.StartEpisode(
            pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=[20, 21, 22]), sampling=sampling),
            metadata=TRACEPARENT,
        )
        ep = started.episode_ids[0]
        for turn in range(2):
            chunks = [c async for c in stub.Step(pb.StepRequest(episode_id=ep, stream=True), metadata=TRACEPARENT)]
            assert chunks[-1].done.turn_index == turn
        await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0]), metadata=TRACEPARENT)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep), metadata=TRACEPARENT)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    spans = exporter.get_finished_spans()
    rpc = [s for s in spans if s.name.startswith(SERVICE)]
    assert not [s for s in spans if s.name.startswith("grpc.health")]  # probes are not traced
    assert [s.name.split("/")[1] for s in rpc] == ["StartEpisode", "Step", "Step", "EndEpisode", "EndEpisode"]
    for s in rpc:  # continued from the client's traceparent
        assert format(s.context.trace_id, "032x") == TRACE_ID
        assert s.parent is not None and format(s.parent.span_id, "016x") == "00f067aa0ba902b7"
    start, step0, step1, end, bad_end = rpc
    assert list(start.attributes["primerl.episode_ids"]) == [ep]
    assert start.attributes["primerl.replica"] == "toy-0"
    for turn, step in enumerate((step0, step1)):
        assert step.attributes["primerl.episode_id"] == ep
        assert step.attributes["primerl.turn"] == turn
        assert step.attributes["primerl.generated_tokens"] == 6
        assert [e.name for e in step.events] == ["first_token"]
        engine = [s for s in spans if s.parent is not None and s.parent.span_id == step.context.span_id]
        assert [s.name for s in engine] == ["engine.generate"]
        assert engine[0].attributes["primerl.episode_id"] == ep
        assert engine[0].attributes["primerl.replica"] == "toy-0"
        assert engine[0].attributes["primerl.prompt_tokens"] == 3 + 6 * turn
        assert engine[0].attributes["primerl.generated_tokens"] == 6
        # One request id names the RPC span and the engine request it made (server.requestid).
        assert engine[0].attributes["primerl.request_id"].startswith(f"{step.attributes['primerl.request_id']}-{turn}-")
    release = [s for s in spans if s.parent is not None and s.parent.span_id == end.context.span_id]
    assert [s.name for s in release] == ["engine.release"]
    assert end.status.is_ok and not bad_end.status.is_ok
    assert bad_end.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_tracing_is_off_by_default_and_engines_are_not_wrapped(start_bridge) -> None:  # type: ignore[no-untyped-def]
    server, client = await start_bridge(engine={"type": "toy"})
    if not tracing_requested():
        assert not server.tracing.enabled and server.tracing.provider is None
        assert all(isinstance(e, ToyEngine) for e in server.bridge.engines)
    ep = (await client.start_episode([5, 6, 7])).episode_ids[0]
    await client.step(ep)


def test_which_otel_variables_turn_tracing_on() -> None:
    assert not tracing_requested({})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"})
    assert Tracing.from_env({}).provider is None


def test_otlp_exporter_is_built_from_the_standard_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SERVICE_NAME": "bridge-under-test"}
    tracing = Tracing.from_env(env)
    try:
        assert tracing.enabled and tracing.provider is not None
        assert tracing.provider.resource.attributes["service.name"] == "bridge-under-test"
        engine = tracing.wrap(ToyEngine.__new__(ToyEngine))
        assert isinstance(engine, TracedEngine)
    finally:
        tracing.shutdown()


def test_with_tracing_off_no_exporter_or_sdk_is_even_imported() -> None:
    """A whole episode in a fresh interpreter with no OTEL_* variables loads no SDK or exporter."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        from rl_client import AsyncBridgeClient
        from server.app import create_server
        from server.config import load_settings

        async def main():
            server = await create_server(load_settings(engine={"type": "toy"}, server={"port": 0}, metrics={"port": 0}))
            await server.start()
            async with AsyncBridgeClient(f"127.0.0.1:{server.port}") as client:
                ep = (await client.start_episode([5, 6, 7])).episode_ids[0]
                await client.step(ep)
                await client.end_episode(ep, 1.0)
            await server.stop(0)
            loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
            print("LOADED", loaded)

        asyncio.run(main())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout
