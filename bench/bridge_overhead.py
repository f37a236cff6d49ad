"""Bridge overhead: a Step through the bridge vs the same toy engine called in-process.

Measured in one run on one machine, as differences/ratios against the in-process baseline:
- p50/p99 added latency of a non-streamed 16-token Step (target <= 1 ms p50);
- added time per streamed token, over 256-token streamed Steps (target <= 30 us);
- Steps/s with 64 concurrent episodes on one bridge process (target >= 2,000).

The bridge runs in its own process (as in production); the client is this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import pct, record, start_bridge
from engines.config import ToyConfig
from engines.toy import ToyEngine
from engines.types import GenerateRequest, SamplingParams
from rl_client import AsyncBridgeClient

PROMPT = [1, 4, 30, 31, 32, 2, 5]


async def direct(n: int, tokens: int) -> list[float]:
    engine = ToyEngine(ToyConfig())
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=1)
    out = []
    for i in range(n):
        start = time.perf_counter()
        async for _ in engine.generate(GenerateRequest(str(i), tuple(PROMPT), params)):
            pass
        out.append(time.perf_counter() - start)
    return out


async def through_bridge(client: AsyncBridgeClient, n: int, tokens: int, stream: bool) -> list[float]:
    sampling = {"max_tokens": tokens, "ignore_eos": True, "seed": 1}
    out = []
    for _ in range(n):
        ep = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
        start = time.perf_counter()
        if stream:
            async for _chunk in client.stream_step(ep):
                pass
        else:
            await client.step(ep)
        out.append(time.perf_counter() - start)
        await client.discard_episode(ep)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(client: AsyncBridgeClient, episodes: int, seconds: float, pid: int) -> tuple[float, float]:
    sampling = {"max_tokens": 16, "ignore_eos": True}
    ids = [(await client.start_episode(PROMPT, sampling=sampling)).episode_id for _ in range(episodes)]
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(ep: str) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await client.step(ep, [9])
            done += 1

    cpu0, start = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker(e) for e in ids))
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
    for e in ids:
        await client.discard_episode(e)
    return done / elapsed, done / cpu


async def main(n: int, seconds: float) -> None:
    base16 = await direct(n, 16)
    base256 = await direct(max(20, n // 10), 256)
    proc, port = start_bridge("--engine", "toy")
    try:
        async with AsyncBridgeClient(f"127.0.0.1:{port}") as client:
            await client.wait_until_ready(60)
            await through_bridge(client, 20, 16, False)  # warm-up
            bridged16 = await through_bridge(client, n, 16, False)
            bridged256 = await through_bridge(client, max(20, n // 10), 256, True)
            steps_per_s, steps_per_cpu_s = await throughput(client, 64, seconds, proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    added_p50 = (pct(bridged16, 50) - pct(base16, 50)) * 1e3
    added_p99 = (pct(bridged16, 99) - pct(base16, 99)) * 1e3
    per_token = (pct(bridged256, 50) - pct(base256, 50)) / 256 * 1e6
    rows = [
        ("in-process 16-token turn p50", f"{pct(base16, 50) * 1e3:.3f} ms", "baseline"),
        ("bridge 16-token Step p50 / p99", f"{pct(bridged16, 50) * 1e3:.3f} / {pct(bridged16, 99) * 1e3:.3f} ms", ""),
        ("added latency p50 / p99", f"{added_p50:.3f} / {added_p99:.3f} ms", "<= 1 ms p50"),
        ("added time per streamed token", f"{per_token:.1f} us", "<= 30 us"),
        ("Steps/s, 64 concurrent episodes (wall clock)", f"{steps_per_s:,.0f}", ">= 2,000"),
        ("Steps per bridge CPU-second (one-core capacity)", f"{steps_per_cpu_s:,.0f}", ""),
    ]
    figures = {
        "added_ms_p50": added_p50,
        "added_ms_p99": added_p99,
        "added_us_per_streamed_token": per_token,
        "steps_per_s_64": steps_per_s,
        "steps_per_bridge_cpu_s": steps_per_cpu_s,
        "ratio_bridge_over_direct_p50": pct(bridged16, 50) / pct(base16, 50),
    }
    record(
        "bridge_overhead",
        "Bridge overhead (toy engine)",
        rows,
        figures,
        notes="Bridge in its own process, client in another, both on this machine's cores.",
        ratios={
            "bridge_over_direct_p50": pct(bridged16, 50) / pct(base16, 50),
            "bridge_over_direct_256_tokens_p50": pct(bridged256, 50) / pct(base256, 50),
        },
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=500, help="Steps per latency measurement")
    ap.add_argument("--seconds", type=float, default=10.0, help="duration of the throughput phase")
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.seconds))
