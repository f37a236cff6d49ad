"""/metrics scraped over HTTP after real episodes through a real gRPC bridge."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.types import GenerateRequest, TokenChunk, Usage
from engines.config import ToyConfig
from engines.launch import free_port
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient, BridgeError
from server.app import BridgeServer, create_server
from server.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
KV_BYTES_PER_TOKEN = 1024
STEP = "primerl.v1.PrimeRL/Step"


class StatefulToy(ToyEngine):
    """The toy model plus per-episode KV bookkeeping, as a stateful engine reports it.

    Each episode's previous request and its sampled tokens are "held"; a turn that extends
    them reports that many cached tokens, and ``kv_bytes`` follows the held tokens.
    """

    def __init__(self) -> None:
        super().__init__(ToyConfig(), replica="toy-0")
        self.held: dict[str, int] = {}

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        cached = min(self.held.get(request.episode_id, 0), len(request.token_ids))
        produced = 0
        async for chunk in super().generate(request):
            produced += len(chunk.token_ids)
            if chunk.finish_reason is not None and chunk.usage is not None:
                chunk = TokenChunk(
                    chunk.token_ids,
                    chunk.logprobs,
                    chunk.policy_version,
                    finish_reason=chunk.finish_reason,
                    usage=Usage(chunk.usage.prompt_tokens, cached, chunk.usage.generated_tokens),
                )
                self.counters.cached_tokens += cached
                self.held[request.episode_id] = len(request.token_ids) + produced
                self.counters.extra["kv_bytes"] = sum(self.held.values()) * KV_BYTES_PER_TOKEN
            yield chunk

    async def release(self, episode_id: str) -> None:
        self.held.pop(episode_id, None)
        self.counters.extra["kv_bytes"] = sum(self.held.values()) * KV_BYTES_PER_TOKEN


async def scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    return await asyncio.to_thread(get)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.fixture
async def metered() -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient, StatefulToy]]:
    engine = StatefulToy()
    settings = load_settings(server={"port": 0, "grace_period_s": 1.0}, metrics={"port": free_port()})
    server = await create_server(settings, [engine])
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30)
    try:
        yield server, client, engine
    finally:
        await client.close()
        await server.stop(0.5)


async def test_scrape_after_an_episode_has_token_counters_latencies_and_hit_ratio(metered, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = metered
    sampling = {"max_tokens": 8, "ignore_eos": True, "seed": 1}
    ep = (await client.start_episode(list(range(20, 30)), sampling=sampling)).episode_ids[0]
    await client.step(ep)  # history 10 tokens, nothing cached
    await client.step(ep, [40, 41, 42])  # history 10 + 8 + 3 = 21, of which 18 are held
    with pytest.raises(BridgeError):
        await client.step("no-such-episode")

    text = await scrape(server.metrics_port)
    me = {"model": "toy", "engine": "toy"}
    assert value(text, "primerl_prompt_tokens_total", **me) == 31
    assert value(text, "primerl_cached_tokens_total", **me) == 18
    assert value(text, "primerl_generated_tokens_total", **me) == 16
    assert value(text, "primerl_turns_total", finish_reason="length", **me) == 2
    assert value(text, "primerl_step_latency_seconds_count", **me) == 2
    assert value(text, "primerl_step_latency_seconds_bucket", le="+Inf", **me) == 2
    assert value(text, "primerl_step_latency_seconds_sum", **me) > 0
    assert value(text, "primerl_ttft_seconds_count", **me) == 2
    assert value(text, "primerl_prefix_cache_hit_ratio", source="engine", **me) == pytest.approx(18 / 31)
    assert value(text, "primerl_active_episodes", model="toy") == 1
    assert value(text, "primerl_rpc_handled_total", method=STEP, code="OK") == 2
    assert value(text, "primerl_rpc_handled_total", method=STEP, code="NOT_FOUND") == 1
    assert value(text, "primerl_rpc_handled_total", method="primerl.v1.PrimeRL/StartEpisode", code="OK") == 1
    assert value(text, "primerl_engine_generated_tokens_total", replica="toy-0") == 16
    assert value(text, "primerl_engine_cached_tokens_total", replica="toy-0") == 18
    assert value(text, "primerl_kv_bytes", replica="toy-0") == 29 * KV_BYTES_PER_TOKEN  # 21 history + 8 sampled
    assert value(text, "primerl_engine_healthy", replica="toy-0") == 1
    assert value(text, "primerl_policy_version", model="toy") == 0

    # The analysis script on this dump prints the same totals.
    dump = tmp_path / "metrics.txt"
    dump.write_text(text)
    script = [sys.executable, str(ROOT / "scripts" / "analyze_metrics.py"), str(dump)]
    out = (
        await asyncio.to_thread(subprocess.run, [*script, "--json"], capture_output=True, text=True, check=True)
    ).stdout
    row = json.loads(out)["models"]["toy/toy"]
    assert (row["prompt"], row["cached"], row["generated"], row["turns"]) == (31, 18, 16, 2)
    assert row["hit_ratio"] == pytest.approx(18 / 31)
    assert row["step_latency_count"] == 2 and 0 < row["step_latency_p50_s"] <= row["step_latency_p99_s"]
    assert json.loads(out)["rpcs_by_code"]["NOT_FOUND"] == 1
    table = (await asyncio.to_thread(subprocess.run, script, capture_output=True, text=True, check=True)).stdout
    assert "toy/toy | 31 | 18 | 16 | 2 | 0.581" in table

    await client.end_episode(ep, 1.0)
    text = await scrape(server.metrics_port)
    assert value(text, "primerl_active_episodes", model="toy") == 0
    assert value(text, "primerl_kv_bytes", replica="toy-0") == 0


async def test_metrics_endpoint_is_off_with_port_zero_and_stops_with_the_server(start_bridge) -> None:  # type: ignore[no-untyped-def]
    server, _ = await start_bridge(engine={"type": "toy"})
    assert server.metrics_port == 0 and server.metrics_endpoint is None

    port = free_port()
    server, _ = await start_bridge(engine={"type": "toy"}, metrics={"port": port})
    assert server.metrics_port == port
    assert "primerl_rpc_handled" in await scrape(port)
    await server.stop(0)
    with pytest.raises(OSError):
        await scrape(port)


async def test_a_taken_metrics_port_is_a_clear_startup_error(start_bridge) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="cannot bind the metrics port"):
            await start_bridge(engine={"type": "toy"}, metrics={"port": taken.getsockname()[1]})
