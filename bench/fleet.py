"""A fleet of bridge processes behind the control plane (issue 21, acceptance 6), on loopback, toy engines.

One private Redis, one control plane (``primerl control serve``) and 1, 2 or 4 bridge processes (``primerl serve``,
``fleet.enabled``, one in-process toy replica each). The trainer side (this process) asks the control plane for
the live bridges (``ListBridges``) and runs 64 episodes spread over them, each Step a unary 16-token turn.
Figures, measured in one run:

- Steps/s and Steps per bridge CPU-second (user + system of every bridge process) for 1, 2 and 4 bridges, and
  for one bridge outside any fleet (the baseline: the ratio is what fleet membership costs per Step, chiefly
  the registry read at each turn open);
- fleet-wide ``UpdateWeights`` latency with 4 bridges: the RPC through one bridge (every bridge paused and
  drained, each replica reloaded once, the version committed), and until all 4 report the new version.

On a 2-core machine the client and the bridges share the cores: more bridges add no CPU, so Steps/s is flat
or falls; Steps per CPU-second is the per-process efficiency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench._common import free_port, record, start_bridge
from bench.bridge_overhead import cpu_seconds
from proto.primerl.v1 import control_pb2 as cpb
from proto.primerl.v1 import control_pb2_grpc as cpb_grpc
from rl_client import AsyncBridgeClient
from tests.integration.redis_proc import PrivateRedis

PROMPT = [1, 4, 30, 31, 32, 2, 5]
TURNS = 16  # per episode, then a fresh one (bounded histories)
CONCURRENCY = 64


class Fleet:
    """Redis, the control plane and ``n`` bridges (``fleet=False``: one bridge outside any fleet)."""

    def __init__(self, redis: PrivateRedis, n: int, fleet: bool = True) -> None:
        env = {"PRIMERL_ENGINE__TYPE": "toy", "PRIMERL_REDIS__URL": redis.url, "PRIMERL_FLEET__ENABLED": str(fleet)}
        self.bridges = [start_bridge(env=env) for _ in range(n)]
        self.control_port = free_port()
        cmd = [sys.executable, "-m", "server", "control", "serve", "--redis-url", redis.url]
        cmd += ["--port", str(self.control_port), "--metrics-port", "0", "--log-level", "WARNING"]
        self.control = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
        self.fleet = fleet
        self.clients: list[AsyncBridgeClient] = []

    async def ready(self) -> None:
        """Every bridge serving and, in a fleet, listed by the control plane; clients open to what it lists."""
        for _, port in self.bridges:
            await AsyncBridgeClient(f"127.0.0.1:{port}").wait_until_ready(180)
        addresses = [f"127.0.0.1:{port}" for _, port in self.bridges]
        if self.fleet:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.control_port}") as channel:
                stub: cpb_grpc.ControlAsyncStub = cpb_grpc.ControlStub(channel)
                for _ in range(600):
                    with_model = await stub.ListBridges(cpb.ListBridgesRequest(model="toy"), wait_for_ready=True)
                    if len(with_model.bridges) == len(self.bridges):
                        break
                    await asyncio.sleep(0.1)
                addresses = sorted(b.address for b in with_model.bridges)
        self.clients = [AsyncBridgeClient(a) for a in addresses]

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p, _ in self.bridges)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        for p in [self.control, *(p for p, _ in self.bridges)]:
            p.terminate()
        for p in [self.control, *(p for p, _ in self.bridges)]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


async def steps(fleet: Fleet, seconds: float) -> tuple[float, float]:
    """(Steps/s, Steps per bridge CPU-second) with ``CONCURRENCY`` episodes spread over the fleet's bridges."""
    sampling = {"max_tokens": 16, "ignore_eos": True}
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(client: AsyncBridgeClient) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            ep = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
            for _ in range(TURNS):
                if time.perf_counter() >= stop:
                    break
                await client.step(ep, [9])
                done += 1
            await client.discard_episode(ep)

    cpu0, start = fleet.cpu(), time.perf_counter()
    await asyncio.gather(*(worker(fleet.clients[i % len(fleet.clients)]) for i in range(CONCURRENCY)))
    elapsed, cpu = time.perf_counter() - start, fleet.cpu() - cpu0
    return done / elapsed, done / cpu


async def update_latency(fleet: Fleet, repeats: int) -> tuple[list[float], list[float]]:
    """(RPC seconds, seconds until every bridge reports the new version) of fleet-wide updates through bridge 0."""
    rpc, converged = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        version = await fleet.clients[0].update_weights("toy:bench")
        rpc.append(time.perf_counter() - start)
        while True:
            infos = await asyncio.gather(*(c.server_info() for c in fleet.clients))
            if all(i.models[0].policy_version >= version for i in infos):
                break
            await asyncio.sleep(0.005)
        converged.append(time.perf_counter() - start)
    return rpc, converged


async def main(seconds: float, repeats: int) -> None:
    redis = PrivateRedis()
    redis.start()
    results: dict[str, tuple[float, float]] = {}
    latency: tuple[list[float], list[float]] = ([], [])
    try:
        for name, n, in_fleet in (("1 bridge, no fleet", 1, False), *((f"{n} bridges", n, True) for n in (1, 2, 4))):
            fleet = Fleet(redis, n, in_fleet)
            try:
                await fleet.ready()
                await steps(fleet, 1.0)  # warm-up
                results[name] = await steps(fleet, seconds)
                print(f"{name}: {results[name][0]:.0f} Steps/s, {results[name][1]:.0f} Steps per CPU-s", flush=True)
                if n == 4:
                    latency = await update_latency(fleet, repeats)
            finally:
                await fleet.close()
    finally:
        redis.close()
    base = results["1 bridge, no fleet"]
    rows = [(f"Steps/s, {k}", f"{v[0]:.0f}", "") for k, v in results.items()]
    rows += [(f"Steps per bridge CPU-second, {k}", f"{v[1]:.0f}", "") for k, v in results.items()]
    membership = results["1 bridges"][1] / base[1]
    rpc, converged = statistics.median(latency[0]) * 1e3, statistics.median(latency[1]) * 1e3
    rows += [
        ("fleet membership: Steps per CPU-s, 1 bridge in a fleet / outside", f"{membership:.3f}", ""),
        ("fleet-wide UpdateWeights, 4 bridges: RPC p50", f"{rpc:.0f} ms", ""),
        ("fleet-wide UpdateWeights, 4 bridges: all at the new version, p50", f"{converged:.0f} ms", ""),
    ]
    notes = (
        f"{CONCURRENCY} concurrent episodes of {TURNS} unary 16-token Steps over the bridges the control plane "
        f"lists, {seconds:.0f} s per configuration; {repeats} updates (toy weights, fleet.poll_s 0.1 s). "
        f"Client, bridges, Redis and control plane share this machine's {os.cpu_count()} cores."
    )
    figures = {k: {"steps_per_s": v[0], "steps_per_cpu_s": v[1]} for k, v in results.items()}
    figures["update_rpc_s"] = latency[0]  # type: ignore[assignment]
    figures["update_converged_s"] = latency[1]  # type: ignore[assignment]
    ratios = {"fleet_membership_steps_per_cpu": membership}
    record("fleet", "Fleet of bridges behind the control plane (toy engines)", rows, figures, notes, ratios)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per configuration")
    parser.add_argument("--repeats", type=int, default=5, help="fleet-wide updates timed with 4 bridges")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.repeats))
