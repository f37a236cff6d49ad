"""Load: many concurrent streaming episodes on one bridge process (toy engine); errors, latency, memory.

One run: open N episodes at once, run T streamed turns on each concurrently, end them; report errors
(target: zero), Step latency p50/p99, bridge RSS before/at peak/after, bridge memory per idle open
episode (RSS with N idle episodes open minus RSS before, over N). ``--soak-s S`` then repeats waves
for S seconds, sampling the bridge's RSS, and reports its growth from the first to the last wave.

Usage: python bench/load.py [--episodes 1000] [--turns 5] [--soak-s 0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import pct, record, start_bridge
from rl_client import AsyncBridgeClient
from rl_client.errors import BridgeError

PROMPT = [1, 4, 30, 31, 32, 2, 5]
OBS = [2, 4, 40, 41, 2, 5]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def wave(client: AsyncBridgeClient, n: int, turns: int, pid: int) -> dict[str, float]:
    errors = 0
    latencies: list[float] = []
    before = rss_mib(pid)
    started = await asyncio.gather(
        *(client.start_episode(PROMPT, sampling={"max_tokens": 16, "seed": i}) for i in range(n)),
        return_exceptions=True,
    )
    eps = [s.episode_id for s in started if not isinstance(s, BaseException)]
    errors += n - len(eps)
    idle = rss_mib(pid)

    async def run(ep: str) -> None:
        nonlocal errors
        for t in range(turns):
            start = time.perf_counter()
            try:
                async for chunk in client.stream_step(ep, OBS if t else None):
                    if chunk.done is not None:
                        break
            except BridgeError:
                errors += 1
                return
            latencies.append(time.perf_counter() - start)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(ep) for ep in eps))
    elapsed = time.perf_counter() - t0
    peak = rss_mib(pid)
    ended = await asyncio.gather(*(client.end_episode(ep, reward=1.0) for ep in eps), return_exceptions=True)
    errors += sum(isinstance(e, BaseException) for e in ended)
    return {
        "episodes": len(eps),
        "errors": errors,
        "steps": len(latencies),
        "steps_per_s": len(latencies) / elapsed,
        "p50_ms": pct(latencies, 50) * 1e3,
        "p99_ms": pct(latencies, 99) * 1e3,
        "rss_before_mib": before,
        "rss_idle_mib": idle,
        "rss_peak_mib": peak,
        "rss_after_mib": rss_mib(pid),
        "kib_per_idle_episode": (idle - before) * 1024 / max(1, len(eps)),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--soak-s", type=float, default=0.0, help="repeat waves for this long and track RSS")
    args = parser.parse_args()

    proc, port = start_bridge("--engine", "toy")
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=300)
    try:
        await client.wait_until_ready(timeout=60)
        await wave(client, 50, 2, proc.pid)  # warm-up
        first = await wave(client, args.episodes, args.turns, proc.pid)
        print(f"wave 1: {first}", flush=True)
        soak: list[float] = [first["rss_after_mib"]]
        waves, soak_errors = 1, int(first["errors"])
        deadline = time.perf_counter() + args.soak_s
        while time.perf_counter() < deadline:
            w = await wave(client, args.episodes, args.turns, proc.pid)
            waves += 1
            soak_errors += int(w["errors"])
            soak.append(w["rss_after_mib"])
            print(f"soak wave {waves}: rss {w['rss_after_mib']:.1f} MiB, errors {w['errors']}", flush=True)
    finally:
        await client.close()
        proc.terminate()
        proc.wait(timeout=60)
    rows = [
        (f"{args.episodes} concurrent streaming episodes x {args.turns} turns: errors", f"{first['errors']:.0f}", "0"),
        ("Steps completed / Steps per second", f"{first['steps']:.0f} / {first['steps_per_s']:.0f}", ""),
        ("Step latency p50 / p99 under that load", f"{first['p50_ms']:.0f} / {first['p99_ms']:.0f} ms", ""),
        (
            "bridge RSS before / idle episodes open / peak / after",
            f"{first['rss_before_mib']:.0f} / {first['rss_idle_mib']:.0f} / {first['rss_peak_mib']:.0f} / "
            f"{first['rss_after_mib']:.0f} MiB",
            "",
        ),
        ("bridge memory per idle open episode", f"{first['kib_per_idle_episode']:.1f} KiB", "bounded"),
    ]
    if args.soak_s:
        growth = soak[-1] - soak[0]
        rows += [
            (f"soak: {waves} waves in {args.soak_s:.0f} s, errors", f"{soak_errors}", "0"),
            ("soak: RSS after first / last wave (growth)", f"{soak[0]:.0f} / {soak[-1]:.0f} MiB ({growth:+.1f})", ""),
        ]
    record(
        "load",
        "Load: concurrent streaming episodes (toy engine)",
        rows,
        {"first_wave": first, "soak_rss_mib": soak, "soak_errors": soak_errors},
        "Bridge in its own process, one client process with all episodes on one channel; same machine.",
        ratios={"errors": soak_errors, "p99_over_p50": first["p99_ms"] / first["p50_ms"]},
    )


if __name__ == "__main__":
    asyncio.run(main())
