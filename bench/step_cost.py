"""Where a Step's server CPU goes: the bridge built up from the bare gRPC floor, one layer at a time.

``bench/bridge_overhead.py`` compares the whole bridge with the floor (bench/grpc_floor.py). This benchmark
splits the difference. Four servers, each in its own process, measured alternately in one run (64 unary
16-token Steps in flight, as bridge_overhead's throughput load), each adding one layer:

1. ``floor``: the bare ``grpc.aio`` server answering the same Step at once;
2. ``server``: a real bridge process (its interceptors, health, reflection, metrics, background tasks) whose
   Step handler is the floor's: what the bridge's server costs around a Step;
3. ``step path``: the bridge's own Step (validate, admit, route, open, stream, close, build the chunk) on a
   toy engine whose sampling is replaced by constant tokens, with bridge_overhead's episodes (32 turns, then
   EndEpisode and a fresh StartEpisode, whose CPU counts per Step; histories stay under 600 tokens);
4. ``toy engine``: the real toy engine's sampling: the bridge exactly as bridge_overhead measures it.

The layers are switched off by patching the bridge process at start-up (``--as-bridge``), never in the
library. Each layer's cost is the difference of the medians of two neighbouring rows.

Run: ``python -m bench.step_cost [--seconds 4] [--rounds 5]`` (about 2 minutes at the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from bench._common import pct, record, start_bridge
from bench.bridge_overhead import TURNS_PER_EPISODE, client_of, load, start_floor
from rl_client import AsyncBridgeClient

# (name, what the row adds, the bridge's patches, whether the server is the floor's process (else a bridge),
# whether the load runs episodes (else bare Steps, as against the floor))
LAYERS: tuple[tuple[str, str, str, bool, bool], ...] = (
    ("floor", "bare grpc.aio server (bench/grpc_floor.py)", "", True, False),
    ("server", "the bridge's server around the floor's Step handler", "floor-step", False, False),
    (
        "step path",
        f"the bridge's Step and episodes ({TURNS_PER_EPISODE} turns each), toy sampling replaced by constant tokens",
        "constant-tokens",
        False,
        True,
    ),
    ("toy engine", "the toy engine's real sampling (the bridge as bridge_overhead runs it)", "", False, True),
)


def patch(switches: str) -> None:
    """Switch layers off in this (bridge) process, before the server is built."""
    names = set(filter(None, switches.split(",")))
    if "constant-tokens" in names:
        from engines.toy import ToyEngine

        def constant(self: Any, history: Any, rng: Any, n: int, stops: Any, predraw: bool) -> Any:
            return [100] * n, [-1.5] * n, False

        ToyEngine._sample_run = constant  # type: ignore[method-assign]
    if "floor-step" in names:
        from bench import grpc_floor
        from server.service import PrimeRLService

        async def step(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            async for chunk in grpc_floor.step(request, context):
                yield chunk

        PrimeRLService.Step = step  # type: ignore[method-assign]


@asynccontextmanager
async def serving(switches: str, floor: bool, episodes: bool) -> AsyncIterator[tuple[AsyncBridgeClient, int]]:
    """A client of a fresh server process (the floor, or a toy bridge patched by ``switches``), warmed up."""
    main = ("-m", "bench.step_cost", "--as-bridge", switches)
    proc, port = start_floor() if floor else start_bridge("--engine", "toy", main=main)
    async with client_of(proc, port, not episodes) as served:
        yield served


async def measure(seconds: float, rounds: int) -> dict[str, list[float]]:
    """Server CPU-seconds per Step of each layer, ``rounds`` times, in alternating order."""
    out: dict[str, list[float]] = {name: [] for name, *_ in LAYERS}
    for r in range(rounds):
        for name, _, switches, floor, episodes in LAYERS if r % 2 == 0 else reversed(LAYERS):
            async with serving(switches, floor, episodes) as (client, pid):
                _, per_cpu_s, _ = await load(client, pid, seconds, floor=not episodes)
            out[name].append(1 / per_cpu_s)
            print(f"round {r + 1}/{rounds}: {name}: {1e6 / per_cpu_s:,.0f} us per Step", flush=True)
    return out


async def main(seconds: float, rounds: int) -> None:
    runs = await measure(seconds, rounds)
    med = {name: pct(xs, 50) for name, xs in runs.items()}
    floor = med["floor"]
    rows = []
    previous = 0.0
    for name, what, *_ in LAYERS:
        added = med[name] - previous
        rows.append(
            (
                f"{name}: {what}",
                f"{med[name] * 1e6:,.0f} us ({med[name] / floor:.2f}x the floor); this layer "
                f"{added * 1e6:+,.0f} us (runs: {', '.join(f'{x * 1e6:.0f}' for x in runs[name])})",
                "",
            )
        )
        previous = med[name]
    rows.append(
        (
            "bridge without the toy engine's sampling / floor (what the bridge itself adds)",
            f"{med['step path'] / floor:.2f}x",
            "",
        )
    )
    figures = {f"{name.replace(' ', '_')}_cpu_us_per_step": med[name] * 1e6 for name, *_ in LAYERS}
    figures["bridge_over_floor"] = med["toy engine"] / floor
    figures["bridge_without_toy_sampling_over_floor"] = med["step path"] / floor
    record(
        "step_cost",
        "Step cost by layer (toy engine, 64 unary 16-token Steps in flight)",
        rows,
        figures,
        notes=f"Each server in its own process, the client in this one; {rounds} alternating rounds of {seconds:g} s "
        "per layer; medians. A layer's cost is its row minus the row above (the medians are of different runs, so "
        "a small layer can come out within the noise, even negative).",
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-bridge"]:
        patch(sys.argv[2])
        from server.cli import main as serve_main

        sys.exit(serve_main(sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured load per layer and round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = ap.parse_args()
    asyncio.run(main(args.seconds, args.rounds))
