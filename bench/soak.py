"""Soak: N concurrent streaming episodes for M minutes on one bridge process (toy engine); memory and latency.

N workers (default 1,000) each run episodes back to back (start, T streamed turns, end) until the time is up,
so N episodes are open at every moment and the bridge creates and frees episodes all the time. The bridge runs
in its own process, so its RSS (read from /proc every ``--sample-s`` seconds) is the bridge's alone.

Reported: errors (target 0), Step latency p99 per minute, and the slope of the RSS minima over the second half of
the run (the minimum of each ``--window-s`` window, a least-squares line through them). A leak shows in the
minima; the sawtooth of the allocator and of the GC does not. The bound is printed before the run starts.
Why 0.5 MiB/min: at ~100 episodes ended per second, a leak of 100 bytes per episode grows RSS by ~0.6 MiB/min.

Usage: python bench/soak.py [--episodes 1000] [--minutes 10] [--turns 4] [--bound-mib-per-min 0.5] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import pct, record, start_bridge
from bench.load import OBS, PROMPT, rss_mib
from rl_client import AsyncBridgeClient
from rl_client.errors import BridgeError

PLOT = Path(__file__).resolve().parent / "plots" / "soak.png"


class Soak:
    """The client side: workers, latencies per minute, RSS samples."""

    def __init__(self, client: AsyncBridgeClient, pid: int, args: argparse.Namespace) -> None:
        self.client, self.pid, self.args = client, pid, args
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.minutes * 60
        self.latencies: dict[int, list[float]] = defaultdict(list)  # minute -> Step latencies (s)
        self.errors: list[str] = []
        self.episodes = 0
        self.samples: list[tuple[float, float]] = []  # (seconds since start, bridge RSS MiB)
        self.rss_after = float("nan")

    async def worker(self, i: int) -> None:
        seed = i
        while time.perf_counter() < self.deadline:
            ep = ""
            try:
                ep = (await self.client.start_episode(PROMPT, sampling={"max_tokens": 16, "seed": seed})).episode_id
                for t in range(self.args.turns):
                    start = time.perf_counter()
                    async for chunk in self.client.stream_step(ep, OBS if t else None):
                        if chunk.done is not None:
                            break
                    now = time.perf_counter()
                    self.latencies[int((now - self.t0) // 60)].append(now - start)
                await self.client.end_episode(ep, reward=1.0)
                self.episodes += 1
            except BridgeError as err:  # every failed RPC is counted and reported, none stops the soak
                self.errors.append(f"{type(err).__name__}: {err}")
                if ep:  # free it now rather than at its idle timeout: a failed Step must not look like a leak
                    with contextlib.suppress(BridgeError):
                        await self.client.discard_episode(ep)
                await asyncio.sleep(0.1)
            seed += self.args.episodes

    async def sampler(self) -> None:
        while time.perf_counter() < self.deadline:
            t = time.perf_counter() - self.t0
            self.samples.append((t, rss_mib(self.pid)))
            if self.args.verbose:
                steps = sum(len(v) for v in self.latencies.values())
                rss = self.samples[-1][1]
                print(f"t={t:6.0f} s  rss={rss:.1f} MiB  steps={steps}  errors={len(self.errors)}", flush=True)
            await asyncio.sleep(self.args.sample_s)

    async def run(self) -> None:
        await asyncio.gather(self.sampler(), *(self.worker(i) for i in range(self.args.episodes)))


def minima_slope(samples: list[tuple[float, float]], window_s: float, since_s: float) -> tuple[list, float]:
    """The minimum RSS of each window from ``since_s`` on, and the least-squares slope through them (MiB/min)."""
    windows: dict[int, tuple[float, float]] = {}
    for t, rss in samples:
        if t >= since_s:
            k = int((t - since_s) // window_s)
            if k not in windows or rss < windows[k][1]:
                windows[k] = (t, rss)
    minima = [windows[k] for k in sorted(windows)]
    if len(minima) < 2:
        return minima, float("nan")
    slope = np.polyfit([t / 60 for t, _ in minima], [r for _, r in minima], 1)[0]
    return minima, float(slope)


def plot(samples: list, minima: list, slope: float, p99: dict[int, float], bound: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOT.parent.mkdir(exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.plot([t / 60 for t, _ in samples], [r for _, r in samples], ".-", lw=0.8, label="RSS sample")
    if len(minima) >= 2:
        xs = np.array([t / 60 for t, _ in minima])
        ys = np.array([r for _, r in minima])
        a1.plot(xs, ys, "o", color="tab:red", label="window minima (2nd half)")
        b = float(np.mean(ys) - slope * np.mean(xs))
        a1.plot(xs, slope * xs + b, "--", color="tab:red", label=f"slope {slope:+.3f} MiB/min (bound {bound})")
    a1.set(xlabel="minute", ylabel="bridge RSS (MiB)", title="Bridge RSS under the soak")
    a1.legend(fontsize=8)
    a2.bar([m + 1 for m in p99], [v * 1e3 for v in p99.values()], color="tab:orange")
    a2.set(xlabel="minute", ylabel="Step p99 (ms)", title="Step latency p99 per minute")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)
    return PLOT.relative_to(PLOT.parent.parent).as_posix()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000, help="concurrent episodes (workers)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the soak")
    parser.add_argument("--turns", type=int, default=4, help="streamed turns per episode")
    parser.add_argument("--sample-s", type=float, default=10.0, help="bridge RSS sampling period")
    parser.add_argument("--window-s", type=float, default=60.0, help="window of each RSS minimum")
    parser.add_argument("--bound-mib-per-min", type=float, default=0.5, help="bound on the RSS-minima slope")
    parser.add_argument("--no-record", action="store_true", help="print only (smoke runs): no RESULTS.md entry")
    parser.add_argument("--verbose", action="store_true", help="print every RSS sample")
    return parser.parse_args()


async def main() -> None:
    args = parse()
    duration = args.minutes * 60
    print(
        f"soak: {args.episodes} concurrent streaming episodes x {args.turns} turns, {args.minutes:g} min; bound "
        f"stated before the run: RSS-minima slope over the last {duration / 120:g} min <= "
        f"{args.bound_mib_per_min} MiB/min, 0 errors",
        flush=True,
    )
    proc, port = start_bridge("--engine", "toy")
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=300)
    try:
        await client.wait_until_ready(timeout=60)
        soak = Soak(client, proc.pid, args)
        await soak.run()
        soak.rss_after = rss_mib(proc.pid)  # every episode ended: not a sample of the soak itself
    finally:
        await client.close()
        proc.terminate()
        proc.wait(timeout=60)
    report(args, soak)


def report(args: argparse.Namespace, soak: Soak) -> None:
    minima, slope = minima_slope(soak.samples, args.window_s, args.minutes * 30)
    p99 = {m: pct(v, 99) for m, v in sorted(soak.latencies.items())}
    steps = sum(len(v) for v in soak.latencies.values())
    within = bool(slope <= args.bound_mib_per_min) and not soak.errors
    summary = {
        "episodes_concurrent": args.episodes,
        "minutes": args.minutes,
        "episodes_completed": soak.episodes,
        "steps": steps,
        "errors": len(soak.errors),
        "first_errors": sorted(collections.Counter(e[:120] for e in soak.errors).items())[:5],
        "rss_samples_mib": soak.samples,
        "rss_minima_mib": minima,
        "rss_after_mib": soak.rss_after,
        "slope_mib_per_min": slope,
        "bound_mib_per_min": args.bound_mib_per_min,
        "p99_ms_per_minute": {m + 1: v * 1e3 for m, v in p99.items()},
        "within_bound": within,
    }
    print("SOAK " + json.dumps(summary, default=float), flush=True)
    if args.no_record:
        return
    rss = [r for _, r in soak.samples]
    rows = [
        (f"{args.episodes} concurrent streaming episodes, {args.minutes:g} min: errors", f"{len(soak.errors)}", "0"),
        ("episodes completed / Steps", f"{soak.episodes} / {steps}", ""),
        (
            "bridge RSS first / min / max / last sample / after every episode ended",
            f"{rss[0]:.0f} / {min(rss):.0f} / {max(rss):.0f} / {rss[-1]:.0f} / {soak.rss_after:.0f} MiB",
            "",
        ),
        (
            f"RSS-minima slope, last {args.minutes / 2:g} min ({len(minima)} minima)",
            f"{slope:+.3f} MiB/min",
            f"<= {args.bound_mib_per_min} (stated before the run)",
        ),
    ]
    rows += [
        (f"Step p99, minute {m + 1}", f"{v * 1e3:.0f} ms ({len(soak.latencies[m])} Steps)", "") for m, v in p99.items()
    ]
    record(
        "soak",
        "Soak: concurrent streaming episodes for minutes (toy engine)",
        rows,
        {k: v for k, v in summary.items() if k != "first_errors"},
        "Bridge in its own process (RSS is the bridge's), one client process driving every episode on one channel, "
        "same 2-core machine; other work on the machine inflates latency, not RSS.",
        ratios={"errors": len(soak.errors), "rss_slope_mib_per_min": slope},
        plots=(plot(soak.samples, minima, slope, p99, args.bound_mib_per_min),),
    )


if __name__ == "__main__":
    asyncio.run(main())
