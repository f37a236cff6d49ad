"""The live inspector's memory bound: 10,000 ended episodes through a toy-engine bridge with the default bound.

Two bridge processes, one after the other, the same load: inspector on (its defaults: ``max_ended_episodes`` 2,000,
``max_ended_bytes`` 64 MiB) and inspector off (the baseline). Each bridge first ends ``--warmup`` episodes (the
process's own caches, gRPC buffers and allocator reach their working size), then its RSS is read
(``/proc/<pid>/status``), then ``--episodes`` more are ended (start: a 64-token prompt; one Step of 32 tokens; end
with a reward; 32 in flight), and its RSS is read again. The figure held to the documented bound is the growth with
the inspector on minus the growth without it: at most ``max_ended_bytes`` + ~1 KiB per kept episode
(``server/inspector/config.py``). The kept count, bytes and evictions come from ``GET /v1/inspect/episodes``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._common import free_port, record, start_bridge
from rl_client import AsyncBridgeClient
from server.inspector import InspectorConfig

CONCURRENCY = 32


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def end_many(client: AsyncBridgeClient, n: int, offset: int) -> None:
    queue = iter(range(offset, offset + n))

    async def worker() -> None:
        for i in queue:
            prompt = [(i * 7 + k) % 500 + 10 for k in range(64)]
            ep = (await client.start_episode(prompt, sampling={"max_tokens": 32, "ignore_eos": True})).episode_ids[0]
            await client.step(ep)
            await client.end_episode(ep, float(i % 2))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def run(enabled: bool, episodes: int, warmup: int) -> dict[str, Any]:
    http_port = free_port()
    env = {"PRIMERL_ENGINE__TYPE": "toy", "PRIMERL_INSPECTOR__ENABLED": str(enabled).lower()}
    proc, port = start_bridge("--http-port", str(http_port), env=env)
    try:
        async with AsyncBridgeClient(f"127.0.0.1:{port}", timeout=60) as client:
            await client.wait_until_ready(120)
            await end_many(client, warmup, 0)
            before = rss_mib(proc.pid)
            began = time.perf_counter()
            await end_many(client, episodes, warmup)
            seconds = time.perf_counter() - began
            after = rss_mib(proc.pid)
        kept: dict[str, Any] = {}
        if enabled:
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.get(f"http://127.0.0.1:{http_port}/v1/inspect/episodes", params={"limit": 1})
            kept = r.json()["kept"]
        return {"before_mib": before, "after_mib": after, "episodes_per_s": episodes / seconds, "kept": kept}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=10_000, help="episodes ended after the warm-up")
    parser.add_argument("--warmup", type=int, default=1_000, help="episodes ended before the first RSS reading")
    args = parser.parse_args()
    on = asyncio.run(run(True, args.episodes, args.warmup))
    off = asyncio.run(run(False, args.episodes, args.warmup))
    defaults = InspectorConfig()
    kept = on["kept"]
    bound_mib = defaults.max_ended_bytes / 2**20 + defaults.max_ended_episodes / 1024
    growth_on, growth_off = on["after_mib"] - on["before_mib"], off["after_mib"] - off["before_mib"]
    added = growth_on - growth_off
    rows = [
        ("episodes ended after the warm-up (each: 64-token prompt, one 32-token Step)", f"{args.episodes:,}", ""),
        ("bridge RSS before -> after, inspector on", f"{on['before_mib']:.1f} -> {on['after_mib']:.1f} MiB", ""),
        ("bridge RSS before -> after, inspector off", f"{off['before_mib']:.1f} -> {off['after_mib']:.1f} MiB", ""),
        ("RSS growth the inspector adds (on - off)", f"{added:.1f} MiB", f"<= {bound_mib:.0f} MiB (documented bound)"),
        ("ended episodes kept / evicted", f"{kept['ended']:,} / {kept['evicted']:,}",
         f"<= {defaults.max_ended_episodes:,} kept"),
        ("bytes kept (encoded records + summaries + overhead)", f"{kept['bytes'] / 2**20:.1f} MiB",
         f"<= {defaults.max_ended_bytes / 2**20:.0f} MiB"),
        ("episodes/s, inspector on / off", f"{on['episodes_per_s']:.0f} / {off['episodes_per_s']:.0f}", ""),
    ]  # fmt: skip
    notes = (
        "Two toy-engine bridge processes in turn (inspector on with its default bound; off), client in this process, "
        f"{CONCURRENCY} episodes in flight. RSS read from /proc after {args.warmup:,} warm-up episodes and again after "
        "the measured ones; the inspector's share is the difference of the two growths."
    )
    figures = {"on": on, "off": off, "added_mib": added, "bound_mib": bound_mib}
    record("inspector", "Live inspector memory bound (10,000 ended episodes)", rows, figures, notes)
    if added > bound_mib or kept["ended"] > defaults.max_ended_episodes:
        raise SystemExit(f"the inspector grew the RSS by {added:.1f} MiB, over its bound of {bound_mib:.0f} MiB")


if __name__ == "__main__":
    main()
