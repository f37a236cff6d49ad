"""Bridge overhead: a Step through the bridge vs the same toy engine called in-process.

Measured in one run on one machine, as differences/ratios against the in-process baseline:
- p50/p99 added latency of a non-streamed 16-token Step (target <= 1 ms p50);
- added time per streamed token, over 256-token streamed Steps (target <= 30 us);
- Steps/s with 64 concurrent episodes on one bridge process (target >= 2,000), with one engine replica and
  with two (cache-aware routing through the prefix index on every turn).

The same Step against a bare gRPC server (bench/grpc_floor.py: same method, same proto, answers at once) is
the floor any Python gRPC service pays on this machine; its latency and Steps/s are reported beside the
bridge's, and the ratios to it are gated. The bridge and the floor each run in their own process (as in
production); the client is this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import free_port, pct, record, start_bridge
from core.types import GenerateRequest, SamplingParams
from engines.config import ToyConfig
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient
from rl_client.errors import UnavailableError

PROMPT = [1, 4, 30, 31, 32, 2, 5]
TURNS_PER_EPISODE = 32  # then a fresh episode: histories stay under 600 tokens (2,100 streamed)
# The Steps whose server CPU is compared with the floor's: (name, tokens, streamed). Streamed Steps of 64 tokens
# arrive in 4 chunks (the toy engine emits 16 tokens at a time; the floor sends the same 4).
MODES = (("unary 16-token", 16, False), ("streamed 64-token", 64, True))


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


async def engine_cpu(n: int, tokens: int) -> float:
    """CPU-seconds of the toy engine alone per ``tokens``-token turn, in this process (what any server that runs
    this engine in-process pays per Step on top of its gRPC costs)."""
    own = time.process_time()
    await direct(n, tokens)
    return (time.process_time() - own) / n


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(pid: int, work: Awaitable[object]) -> tuple[float, float, float]:
    """Run ``work``: (wall seconds, CPU seconds of the server process ``pid``, CPU seconds of this client)."""
    cpu0, own0, start = cpu_seconds(pid), time.process_time(), time.perf_counter()
    await work
    return time.perf_counter() - start, cpu_seconds(pid) - cpu0, time.process_time() - own0


async def load(
    client: AsyncBridgeClient,
    pid: int,
    seconds: float,
    *,
    tokens: int = 16,
    stream: bool = False,
    floor: bool = False,
    turns: int = TURNS_PER_EPISODE,
) -> tuple[float, float, float]:
    """(Steps/s, Steps per server CPU-second, client CPU-seconds per Step) with 64 Steps in flight, each of
    ``tokens`` tokens, whole or ``stream``ed. Against the bridge each of the 64 episodes runs ``turns`` turns,
    then a fresh one takes its place (bounded histories, as in RL rollouts; StartEpisode and EndEpisode calls
    are not counted as Steps, their CPU is); against the floor (``floor``) there are no episodes."""
    sampling = {"max_tokens": tokens, "ignore_eos": True}
    per_step = {"max_tokens": tokens} if floor else None  # the floor has no episode to remember it
    done = 0
    stop = time.perf_counter() + seconds

    async def one(ep: str) -> None:
        if stream:
            async for _chunk in client.stream_step(ep, [9], sampling=per_step):
                pass
        else:
            await client.step(ep, [9], sampling=per_step)

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            ep = "floor" if floor else (await client.start_episode(PROMPT, sampling=sampling)).episode_id
            for _ in range(turns):
                if time.perf_counter() >= stop:
                    break
                await one(ep)
                done += 1
            if not floor:
                await client.discard_episode(ep)

    elapsed, cpu, own = await measured(pid, asyncio.gather(*(worker() for _ in range(64))))
    return done / elapsed, done / cpu, own / done


async def throughput(
    client: AsyncBridgeClient, episodes: int, seconds: float, pid: int, turns: int = TURNS_PER_EPISODE
) -> tuple[float, float, float]:
    """(Steps/s, Steps per bridge CPU-second, client CPU-seconds per Step), 64 unary 16-token Steps in flight."""
    assert episodes == 64
    return await load(client, pid, seconds, turns=turns)


def checkout(rev: str) -> Path:
    """``rev`` of this repository as a plain directory tree (bench/.rev-<sha>, reused), for a side-by-side run."""
    repo = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", rev], cwd=repo, capture_output=True, text=True, check=True).stdout
    tree = repo / "bench" / f".rev-{sha.strip()[:12]}"
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "archive", sha.strip()], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


@asynccontextmanager
async def serving(
    floor: bool = False, tree: Path | None = None, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[AsyncBridgeClient, int]]:
    """A client of a fresh server process and its pid: the bare gRPC floor (``floor``) or a toy bridge (of the
    code in ``tree``, None: this tree; ``env``: extra PRIMERL_* settings), warmed up."""
    proc, port = start_floor() if floor else start_bridge("--engine", "toy", env=env, tree=tree)
    async with client_of(proc, port, floor) as served:
        yield served


@asynccontextmanager
async def client_of(
    proc: subprocess.Popen[bytes], port: int, floor: bool
) -> AsyncIterator[tuple[AsyncBridgeClient, int]]:
    """A warmed-up client of the server process ``proc`` on ``port`` and its pid; the process is stopped after.
    ``floor``: it serves the floor's Step handler (no episodes; waited for with Steps, not the health service)."""
    try:
        async with AsyncBridgeClient(f"127.0.0.1:{port}") as client:
            if floor:
                for _ in range(300):  # until it listens (it has no health service)
                    try:
                        await client.step("floor")
                        break
                    except UnavailableError:
                        await asyncio.sleep(0.1)
                for _ in range(20):
                    await client.step("floor")
            else:
                await client.wait_until_ready(60)
                await through_bridge(client, 20, 16, False)  # warm-up
            yield client, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


async def cpu_per_step(tree: Path | None, seconds: float) -> float:
    """Bridge CPU-seconds per Step (64 in flight, one toy replica) of the code in ``tree`` (None: this tree)."""
    async with serving(tree=tree) as (client, pid):
        _, per_cpu_s, _ = await load(client, pid, seconds)
        return 1 / per_cpu_s


async def against(rev: str, seconds: float, rounds: int) -> tuple[list[float], list[float]]:
    """Bridge CPU per Step of this tree and of ``rev``, measured alternately ``rounds`` times each in this run."""
    tree = checkout(rev)
    here: list[float] = []
    there: list[float] = []
    for _ in range(rounds):
        here.append(await cpu_per_step(None, seconds))
        there.append(await cpu_per_step(tree, seconds))
    return here, there


def start_floor() -> tuple[subprocess.Popen[bytes], int]:
    """bench/grpc_floor.py in its own process: the bare gRPC cost of a Step on this machine."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.grpc_floor", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1]), port


async def sequential(client: AsyncBridgeClient, n: int) -> list[float]:
    """Latencies of ``n`` Steps one after another on the floor."""
    lat = []
    for _ in range(n):
        start = time.perf_counter()
        await client.step("floor")
        lat.append(time.perf_counter() - start)
    return lat


@dataclass
class Pair:
    """One kind of Step under load, on the bridge and on the floor, one measurement per round."""

    bridge: list[tuple[float, float, float]] = field(default_factory=list)  # (Steps/s, server CPU/Step, client's)
    floor: list[tuple[float, float, float]] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [b[1] / f[1] for b, f in zip(self.bridge, self.floor, strict=True)]

    def median(self, side: str, i: int) -> float:
        return pct([x[i] for x in getattr(self, side)], 50)


async def side_by_side(
    bridge: tuple[AsyncBridgeClient, int], floor: tuple[AsyncBridgeClient, int], seconds: float, rounds: int
) -> dict[str, Pair]:
    """Each kind of Step (MODES) under load on the bridge and on the floor, alternately, ``rounds`` times: the same
    machine load for both, so their ratio holds while the machine's load drifts (other work on its cores)."""
    out = {name: Pair() for name, _, _ in MODES}
    for r in range(rounds):
        for name, tokens, stream in MODES:
            sides = [("bridge", bridge), ("floor", floor)]
            for side, (client, pid) in sides if r % 2 == 0 else reversed(sides):
                steps_per_s, per_cpu_s, own = await load(
                    client, pid, seconds, tokens=tokens, stream=stream, floor=side == "floor"
                )
                getattr(out[name], side).append((steps_per_s, 1 / per_cpu_s, own))
    return out


def cpu_row(name: str, pair: Pair, rounds: int) -> tuple[str, str, str]:
    ratios = pair.ratios()
    return (
        f"server CPU per {name} Step, bridge / bare gRPC server (64 in flight; median of {rounds} alternating "
        "rounds, range of the per-round ratio)",
        f"{pair.median('bridge', 1) * 1e6:,.0f} / {pair.median('floor', 1) * 1e6:,.0f} us = "
        f"{pct(ratios, 50):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)",
        "<= 1.3x",
    )


async def main(n: int, seconds: float, rev: str = "", rounds: int = 3) -> None:
    base16 = await direct(n, 16)
    base256 = await direct(max(20, n // 10), 256)
    engine = {tokens: await engine_cpu(max(200, n), tokens) for _, tokens, _ in MODES}
    async with serving(floor=True) as floor, serving() as bridge:
        floor16 = await sequential(floor[0], n)
        bridged16 = await through_bridge(bridge[0], n, 16, False)
        bridged256 = await through_bridge(bridge[0], max(20, n // 10), 256, True)
        pairs = await side_by_side(bridge, floor, seconds, rounds)
    # Two replicas: every turn is routed through the prefix index (cache-aware), as in a fleet.
    async with serving(env={"PRIMERL_ENGINE__REPLICAS": "2"}) as (client, pid):
        routed_per_s, routed_per_cpu_s, _ = await load(client, pid, seconds)
    unary, streamed = pairs[MODES[0][0]], pairs[MODES[1][0]]
    steps_per_s, bridge_cpu, client_cpu = (unary.median("bridge", i) for i in range(3))
    floor_per_s, floor_cpu, floor_client_cpu = (unary.median("floor", i) for i in range(3))
    steps_per_cpu_s, floor_per_cpu_s = 1 / bridge_cpu, 1 / floor_cpu
    added_p50 = (pct(bridged16, 50) - pct(base16, 50)) * 1e3
    added_p99 = (pct(bridged16, 99) - pct(base16, 99)) * 1e3
    per_token = (pct(bridged256, 50) - pct(base256, 50)) / 256 * 1e6
    floor_p50 = pct(floor16, 50)
    # What this machine's CPUs allow at most: the server and the client share its cores, so Steps/s can never
    # exceed cores / (server + client CPU per Step). Both costs are measured above, in this run.
    cores = os.cpu_count() or 1
    ceiling = cores / (bridge_cpu + client_cpu)
    floor_ceiling = cores / (1 / floor_per_cpu_s + floor_client_cpu)
    rows = [
        ("in-process 16-token turn p50", f"{pct(base16, 50) * 1e3:.3f} ms", "baseline"),
        (
            "bare gRPC Step p50 / p99 (floor server, no bridge)",
            f"{floor_p50 * 1e3:.3f} / {pct(floor16, 99) * 1e3:.3f} ms",
            "",
        ),
        ("bridge 16-token Step p50 / p99", f"{pct(bridged16, 50) * 1e3:.3f} / {pct(bridged16, 99) * 1e3:.3f} ms", ""),
        ("added latency p50 / p99", f"{added_p50:.3f} / {added_p99:.3f} ms", "<= 1 ms p50"),
        ("added time per streamed token", f"{per_token:.1f} us", "<= 30 us"),
        ("bridge Step p50 / bare gRPC Step p50", f"{pct(bridged16, 50) / floor_p50:.2f}x", ""),
        (
            "bare gRPC Steps/s, 64 in flight (wall clock) / per server CPU-second",
            f"{floor_per_s:,.0f} / {floor_per_cpu_s:,.0f}",
            "",
        ),
        ("Steps/s, 64 concurrent episodes (wall clock)", f"{steps_per_s:,.0f}", ">= 2,000"),
        ("Steps per bridge CPU-second (one-core capacity)", f"{steps_per_cpu_s:,.0f}", ""),
        (
            "CPU per Step: bridge / client (bare gRPC server / client)",
            f"{bridge_cpu * 1e6:,.0f} / {client_cpu * 1e6:,.0f} us ({1e6 / floor_per_cpu_s:,.0f} / "
            f"{floor_client_cpu * 1e6:,.0f} us)",
            "",
        ),
        (
            f"CPU-bound ceiling on these {cores} cores, bridge (bare gRPC server)",
            f"{ceiling:,.0f} ({floor_ceiling:,.0f}) Steps/s",
            "",
        ),
        ("Steps/s, 2 replicas, cache-aware routing (wall clock)", f"{routed_per_s:,.0f}", ""),
        *(cpu_row(name, pair, rounds) for name, pair in pairs.items()),
        *(
            (
                f"the toy engine's own CPU per {tokens}-token turn; (bare gRPC server + it) / bare gRPC server",
                f"{engine[tokens] * 1e6:,.0f} us; {1 + engine[tokens] / pairs[name].median('floor', 1):.2f}x",
                "the least a bridge running it in-process can reach",
            )
            for name, tokens, _ in MODES
        ),
        ("Steps per bridge CPU-second, 2 replicas", f"{routed_per_cpu_s:,.0f}", ""),
    ]
    figures = {
        "added_ms_p50": added_p50,
        "added_ms_p99": added_p99,
        "added_us_per_streamed_token": per_token,
        "steps_per_s_64": steps_per_s,
        "steps_per_bridge_cpu_s": steps_per_cpu_s,
        "steps_per_s_64_two_replicas": routed_per_s,
        "steps_per_bridge_cpu_s_two_replicas": routed_per_cpu_s,
        "ratio_bridge_over_direct_p50": pct(bridged16, 50) / pct(base16, 50),
        "grpc_floor_ms_p50": floor_p50 * 1e3,
        "grpc_floor_steps_per_s_64": floor_per_s,
        "grpc_floor_steps_per_server_cpu_s": floor_per_cpu_s,
        "bridge_cpu_us_per_step": bridge_cpu * 1e6,
        "client_cpu_us_per_step": client_cpu * 1e6,
        "grpc_floor_client_cpu_us_per_step": floor_client_cpu * 1e6,
        "cpu_ceiling_steps_per_s": ceiling,
        "grpc_floor_cpu_ceiling_steps_per_s": floor_ceiling,
        "streamed64_bridge_cpu_us_per_step": streamed.median("bridge", 1) * 1e6,
        "streamed64_grpc_floor_cpu_us_per_step": streamed.median("floor", 1) * 1e6,
        "engine_cpu_us_per_turn_16": engine[16] * 1e6,
        "engine_cpu_us_per_turn_64": engine[64] * 1e6,
        "unary16_floor_plus_engine_over_floor": 1 + engine[16] / unary.median("floor", 1),
        "streamed64_floor_plus_engine_over_floor": 1 + engine[64] / streamed.median("floor", 1),
        "unary16_cpu_ratio_rounds": unary.ratios(),
        "streamed64_cpu_ratio_rounds": streamed.ratios(),
    }
    ratios: dict[str, float] = {}
    if rev:
        here, there = await against(rev, seconds, rounds)
        mine, theirs = pct(here, 50), pct(there, 50)
        rows.append(
            (
                f"bridge CPU per Step, this tree / {rev} (median of {rounds} alternating runs each)",
                f"{mine * 1e6:,.0f} / {theirs * 1e6:,.0f} us = {mine / theirs:.3f}x "
                f"(runs: {', '.join(f'{x * 1e6:.0f}' for x in here)} / {', '.join(f'{x * 1e6:.0f}' for x in there)})",
                "<= 1.0x",
            )
        )
        figures["bridge_cpu_us_per_step_vs_rev"] = mine * 1e6
        figures["rev_bridge_cpu_us_per_step"] = theirs * 1e6
        ratios["bridge_cpu_per_step_over_rev"] = mine / theirs
    record(
        "bridge_overhead",
        "Bridge overhead (toy engine)",
        rows,
        figures,
        notes="Bridge in its own process, client in another, both on this machine's cores. Throughput: "
        f"64 episodes in flight, each {TURNS_PER_EPISODE} turns of 16 tokens, then a fresh one; one replica "
        "(nothing to route) and two (each turn looked up and recorded in the prefix index). CPU-bound ceiling: "
        "cores / (server + client CPU per Step), from the costs measured in this run: no server can exceed it here "
        "with its client on the same cores (one bridge process also runs its Python on one core at a time).",
        ratios={
            **ratios,
            "bridge_over_direct_p50": pct(bridged16, 50) / pct(base16, 50),
            "bridge_over_grpc_floor_p50": pct(bridged16, 50) / floor_p50,
            "bridge_cpu_efficiency_vs_grpc_floor": steps_per_cpu_s / floor_per_cpu_s,
            "bridge_cpu_over_grpc_floor_unary16": pct(unary.ratios(), 50),
            "bridge_cpu_over_grpc_floor_streamed64": pct(streamed.ratios(), 50),
            "bridge_over_direct_256_tokens_p50": pct(bridged256, 50) / pct(base256, 50),
        },
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=500, help="Steps per latency measurement")
    ap.add_argument("--seconds", type=float, default=10.0, help="duration of the throughput phase")
    ap.add_argument("--against", default="", metavar="REV", help="also measure the bridge of git revision REV")
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating bridge/floor load rounds (and runs per tree with --against)"
    )
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.seconds, args.against, args.rounds))
