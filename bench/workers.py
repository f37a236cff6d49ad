"""``primerl serve --workers 2`` vs one worker: Steps/s and Steps per bridge CPU-second, side by side in one run.

Each round starts a toy-engine bridge with 1 worker, then one with 2 (alternating, ``--rounds`` times), and
drives it with ``--inflight`` unary 16-token Steps in flight in total over 8 channels per generator process (one
TCP connection each, so the kernel spreads them over the workers). The default generator
(``--generator cpp``) is one process of bench/loadgen/stepgen.cc (gRPC C++, generic stub; built by ``make
bench/loadgen/stepgen``, which this script runs when the binary is missing or stale): its CPU per Step is a
fraction of the bridge's, so on 2 cores it leaves the second worker most of a core. ``--generator python``
runs ``--generators`` Python processes instead (raw ``grpc.aio`` multicallables, requests serialized once per
episode, responses never parsed: as cheap as a Python client can be, yet about as costly per Step as the
bridge). Every episode runs 32 turns, then a fresh one takes its place (StartEpisode / EndEpisode are not
counted as Steps; their CPU is).

Bridge CPU is the user+system time of the whole process tree (``primerl serve``'s parent and its workers)
over the measured window; Steps per bridge CPU-second is the efficiency a second worker must keep (target:
within 10 % of one worker), Steps/s the capacity it must add (target: >= 1.5x). On a machine whose cores the
generators need too, Steps/s cannot double: one worker already keeps more than a core busy (gRPC's threads
beside its event loop) and the generators' CPU per Step is printed, and the bound row turns both into the most
2 workers can reach over 1 there.

A third configuration starts every episode through one worker and steps and ends it through the other
(every Step forwarded over the private socket): what forwarding costs in bridge CPU per Step (driven by the
Python generators, which find each connection's worker first).

Usage: python -m bench.workers [--seconds 10] [--rounds 3] [--generator cpp|python] [--generators 2] [--inflight 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import pct, record, start_bridge
from bench.bridge_overhead import PROMPT, TURNS_PER_EPISODE, cpu_seconds
from proto.primerl.v1 import primerl_pb2 as pb

SERVICE = "/primerl.v1.PrimeRL/"
SETTLE_S = 3.0  # generators run this long before the measured window (connections up, episodes open)
STEPGEN = Path(__file__).resolve().parent / "loadgen" / "stepgen"


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process under it (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone while listing
    tree, frontier = [pid], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # a process that ended: not counted (none ends during a window)
            total += cpu_seconds(pid)
    return total


async def _partners(
    chans: list[grpc.aio.Channel], start_req: bytes, cross: bool, connect: Callable[[], grpc.aio.Channel]
) -> list[grpc.aio.Channel]:
    """The channel each channel's episodes are stepped through: itself, or (``cross``) one on another worker
    (``connect``: a new channel, opened while every connection so far reached one worker; the kernel spreads
    connections by a hash, so 8 of them all land on one of 2 workers about once in 128 runs)."""
    if not cross:
        return chans

    async def owner(chan: grpc.aio.Channel) -> str:
        start = chan.unary_unary(SERVICE + "StartEpisode", None, pb.StartEpisodeResponse.FromString)
        ep = (await start(start_req)).episode_ids[0]
        await chan.unary_unary(SERVICE + "EndEpisode", None, None)(
            pb.EndEpisodeRequest(episode_id=ep, discard=True).SerializeToString()
        )
        return str(ep.split("-")[1])

    owners = [await owner(chan) for chan in chans]
    pool = list(zip(chans, owners, strict=True))
    tries = 0
    while len({o for _, o in pool}) < 2:
        if tries == 64:
            raise RuntimeError(f"{len(chans) + tries} connections all reached worker {owners[0]}: cannot cross")
        chan, tries = connect(), tries + 1
        if (found := await owner(chan)) == owners[0]:
            await chan.close(None)  # the same worker again: of no use here
        else:
            pool.append((chan, found))
    others = [[c for c, o in pool if o != mine] for mine in owners]
    return [other[i % len(other)] for i, other in enumerate(others)]


async def _generate(
    port: int, channels: int, inflight: int, begin: float, seconds: float, cross: bool = False
) -> tuple[int, float]:
    """Steps completed inside [begin, begin + seconds] (wall clock) and this process's CPU over that window;
    ``cross``: every episode is started through one worker and stepped and ended through another."""
    opts = [("grpc.use_local_subchannel_pool", 1)]

    def connect() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)

    chans = [connect() for _ in range(channels)]
    start_req = pb.StartEpisodeRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True)
    ).SerializeToString()
    partners = await _partners(chans, start_req, cross, connect)
    end = begin + seconds
    done = 0
    cpu: list[float] = []

    async def loop(i: int) -> None:
        nonlocal done
        chan = chans[i % channels]
        start = chan.unary_unary(SERVICE + "StartEpisode", None, pb.StartEpisodeResponse.FromString)
        step = partners[i % channels].unary_stream(SERVICE + "Step", None, None)
        close = partners[i % channels].unary_unary(SERVICE + "EndEpisode", None, None)
        while time.time() < end:
            ep = (await start(start_req)).episode_ids[0]
            req = pb.StepRequest(episode_id=ep, observation_token_ids=pb.TokenIds(ids=[9])).SerializeToString()
            for _ in range(TURNS_PER_EPISODE):
                async for _chunk in step(req):
                    pass
                if begin <= time.time() <= end:
                    done += 1
                elif time.time() > end:
                    break
            await close(pb.EndEpisodeRequest(episode_id=ep, discard=True).SerializeToString())

    async def clock() -> None:
        await asyncio.sleep(max(0.0, begin - time.time()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu.append(time.process_time())

    await asyncio.gather(clock(), *(loop(i) for i in range(inflight)))
    for chan in {*chans, *partners}:
        await chan.close(None)
    return done, cpu[1] - cpu[0]


def _generator(
    port: int,
    channels: int,
    inflight: int,
    begin: float,
    seconds: float,
    cross: bool,
    out: multiprocessing.Queue[tuple[int, float]],
) -> None:
    out.put(asyncio.run(_generate(port, channels, inflight, begin, seconds, cross)))


def ensure_stepgen() -> Path:
    """The C++ generator, built (``make bench/loadgen/stepgen``: Debian's libgrpc++-dev, g++) when missing or
    older than its source."""
    source = STEPGEN.with_name("stepgen.cc")
    if not STEPGEN.exists() or STEPGEN.stat().st_mtime < source.stat().st_mtime:
        print("building the C++ load generator (make bench/loadgen/stepgen) ...", flush=True)
        subprocess.run(["make", "--no-print-directory", "bench/loadgen/stepgen"], cwd=STEPGEN.parents[2], check=True)
    return STEPGEN


def _stepgen(port: int, inflight: int, begin: float, seconds: float) -> subprocess.Popen[str]:
    """One C++ generator process; it prints ``{"steps", "cpu_s", "errors"}`` after the window."""
    for message in (pb.StepRequest, pb.EndEpisodeRequest):  # stepgen writes the episode id as field 1
        assert message.DESCRIPTOR.fields_by_name["episode_id"].number == 1, message
    assert pb.StartEpisodeResponse.DESCRIPTOR.fields_by_name["episode_ids"].number == 1
    start = pb.StartEpisodeRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True)
    )
    step = pb.StepRequest(observation_token_ids=pb.TokenIds(ids=[9]))
    end = pb.EndEpisodeRequest(discard=True)
    args = [port, begin, seconds, inflight, 8, TURNS_PER_EPISODE] + [
        m.SerializeToString().hex() for m in (start, step, end)
    ]
    return subprocess.Popen([str(STEPGEN), *map(str, args)], stdout=subprocess.PIPE, text=True)


def _wait_for_workers(port: int, workers: int, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    """Until new connections reach every worker (a StartEpisode's id names the worker that served it)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while len(seen) < workers:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the bridge with {workers} worker(s) did not come up (exit code {proc.poll()})")
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as chan:
            start = chan.unary_unary(SERVICE + "StartEpisode", None, pb.StartEpisodeResponse.FromString)
            req = pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT)).SerializeToString()
            try:
                ep = start(req, timeout=5, wait_for_ready=True).episode_ids[0]
            except grpc.RpcError:
                time.sleep(0.5)
                continue
            end = chan.unary_unary(SERVICE + "EndEpisode", None, None)
            end(pb.EndEpisodeRequest(episode_id=ep, discard=True).SerializeToString(), timeout=5)
            seen.add(ep.split("-")[1] if workers > 1 else "w0")


@dataclass
class Run:
    steps_per_s: float
    steps_per_cpu_s: float
    gen_cpu_us_per_step: float


@dataclass
class Side:
    runs: list[Run] = field(default_factory=list)

    def median(self, name: str) -> float:
        return pct([getattr(r, name) for r in self.runs], 50)


def _python_generators(
    port: int, generators: int, inflight: int, begin: float, seconds: float, cross: bool
) -> Callable[[], list[tuple[int, float]]]:
    """``generators`` Python processes started; the returned function collects their (Steps, CPU seconds)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    args = (port, 8, inflight // generators, begin, seconds, cross, out)
    procs = [ctx.Process(target=_generator, args=args) for _ in range(generators)]
    for p in procs:
        p.start()

    def collect() -> list[tuple[int, float]]:
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        return results

    return collect


def _cpp_generator(port: int, inflight: int, begin: float, seconds: float) -> Callable[[], list[tuple[int, float]]]:
    gen = _stepgen(port, inflight, begin, seconds)

    def collect() -> list[tuple[int, float]]:
        stdout, _ = gen.communicate(timeout=120)
        result = json.loads(stdout)
        if gen.returncode or result["errors"]:
            raise RuntimeError(f"stepgen exited with {gen.returncode}, {result['errors']} failed calls")
        return [(result["steps"], result["cpu_s"])]

    return collect


def _busy(seconds: float, out: multiprocessing.Queue[tuple[int, float, float]]) -> None:
    """Bridge-like Python work (build and serialize a StepChunk, parse a StepRequest, a dict) for ``seconds``:
    units of work done, CPU seconds, wall seconds."""
    ids, lps = list(range(16)), [-0.5] * 16
    request = pb.StepRequest(episode_id="ep-w0-x", observation_token_ids=pb.TokenIds(ids=[9])).SerializeToString()
    units, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() < wall0 + seconds:
        for i in range(100):
            chunk = pb.StepChunk(token_ids=ids, logprobs=lps, origins=ids)
            chunk.done.policy_version = i
            pb.StepRequest.FromString(request)
            units += len({k: chunk.SerializeToString() for k in range(8)}) // 8  # one unit
    out.put((units, time.process_time() - cpu0, time.perf_counter() - wall0))


def machine_scaling(seconds: float, rounds: int) -> tuple[float, float]:
    """What this machine gives a second busy process, whatever the bridge does: the same Python work in 2
    processes at once over 1 alone, as (work per CPU-second, work per second); medians of ``rounds``."""
    ctx = multiprocessing.get_context("spawn")
    per_cpu, per_s = [], []
    for _ in range(rounds):
        rates = []
        for n in (1, 2):
            out = ctx.Queue()
            procs = [ctx.Process(target=_busy, args=(seconds, out)) for _ in range(n)]
            for p in procs:
                p.start()
            results = [out.get(timeout=seconds + 60) for _ in procs]
            for p in procs:
                p.join(30)
            rates.append((sum(u / c for u, c, _ in results) / n, sum(u / w for u, _, w in results)))
        per_cpu.append(rates[1][0] / rates[0][0])
        per_s.append(rates[1][1] / rates[0][1])
    return pct(per_cpu, 50), pct(per_s, 50)


def measure(workers: int, seconds: float, generator: str, generators: int, inflight: int, cross: bool = False) -> Run:
    """One bridge with ``workers`` workers under load for ``seconds``; ``cross`` needs the Python generators."""
    proc, port = start_bridge("--engine", "toy", "--workers", str(workers))
    try:
        _wait_for_workers(port, workers, proc)
        begin = time.time() + SETTLE_S + 2.0  # + the generators' own start-up
        if generator == "cpp" and not cross:
            collect = _cpp_generator(port, inflight, begin, seconds)
        else:
            collect = _python_generators(port, generators, inflight, begin, seconds, cross)
        time.sleep(max(0.0, begin - time.time()))
        tree = _descendants(proc.pid)
        cpu0, wall0 = tree_cpu(tree), time.perf_counter()
        time.sleep(max(0.0, begin + seconds - time.time()))
        cpu1, wall1 = tree_cpu(tree), time.perf_counter()
        results = collect()
        steps = sum(r[0] for r in results)
        gen_cpu = sum(r[1] for r in results)
        assert len(tree) >= workers + (workers > 1), f"{workers} worker(s) but processes {tree}"
        return Run(steps / (wall1 - wall0), steps / (cpu1 - cpu0), gen_cpu / max(steps, 1) * 1e6)
    finally:
        proc.terminate()
        proc.wait(60)


def main(seconds: float, rounds: int, generator: str, generators: int, inflight: int) -> None:
    load = os.getloadavg()[0]
    if generator == "cpp":
        ensure_stepgen()
    sides = {"1": Side(), "2": Side(), "2x": Side()}  # 2x: 2 workers, every Step and EndEpisode forwarded
    order = ["1", "2", "2x"]
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            run = measure(int(name[0]), seconds, generator, generators, inflight, cross=name == "2x")
            sides[name].runs.append(run)
            print(
                f"round {r + 1}, {name} worker(s): {run.steps_per_s:,.0f} Steps/s, "
                f"{run.steps_per_cpu_s:,.0f} Steps per bridge CPU-s, generators {run.gen_cpu_us_per_step:,.0f} us/Step",
                flush=True,
            )
    probe_cpu, probe_tput = machine_scaling(3.0, 3)
    one, two, cross = sides["1"], sides["2"], sides["2x"]
    forward_us = (1 / cross.median("steps_per_cpu_s") - 1 / two.median("steps_per_cpu_s")) * 1e6
    tput = two.median("steps_per_s") / one.median("steps_per_s")
    eff = two.median("steps_per_cpu_s") / one.median("steps_per_cpu_s")
    tput_rounds = [b.steps_per_s / a.steps_per_s for a, b in zip(one.runs, two.runs, strict=True)]
    eff_rounds = [b.steps_per_cpu_s / a.steps_per_cpu_s for a, b in zip(one.runs, two.runs, strict=True)]
    cores = os.cpu_count() or 1
    # What the cores allow. One worker keeps more than one core busy (gRPC's poller and event-engine threads run
    # beside its event loop); every Step also costs the generators' CPU. With every core busy, 2 workers cannot
    # pass cores / (bridge + generator CPU per Step); at one worker's Steps per CPU-second (the most the machine
    # row lets 2 processes keep) that bounds their Steps/s over one worker's by cores / (used_1 * (1 + gen / bridge)).
    used_1 = one.median("steps_per_s") / one.median("steps_per_cpu_s")
    gen_us = min(one.median("gen_cpu_us_per_step"), two.median("gen_cpu_us_per_step"))
    bound = cores / (one.median("steps_per_s") * (1 / one.median("steps_per_cpu_s") + gen_us / 1e6))
    ceiling_2 = cores / (1 / two.median("steps_per_cpu_s") + two.median("gen_cpu_us_per_step") / 1e6)
    rows = [
        ("Steps/s, 1 worker / 2 workers", f"{one.median('steps_per_s'):,.0f} / {two.median('steps_per_s'):,.0f}", ""),
        ("Steps/s, 2 workers over 1", f"{tput:.2f}x (rounds {', '.join(f'{x:.2f}' for x in tput_rounds)})", ">= 1.5x"),
        (
            "Steps per bridge CPU-second, 1 worker / 2 workers",
            f"{one.median('steps_per_cpu_s'):,.0f} / {two.median('steps_per_cpu_s'):,.0f}",
            "",
        ),
        (
            "Steps per CPU-second, 2 workers over 1",
            f"{eff:.2f} (rounds {', '.join(f'{x:.2f}' for x in eff_rounds)})",
            ">= 0.90",
        ),
        (
            "2 workers, every Step forwarded to the other: Steps/s / Steps per bridge CPU-s",
            f"{cross.median('steps_per_s'):,.0f} / {cross.median('steps_per_cpu_s'):,.0f}",
            "",
        ),
        ("bridge CPU a forwarded Step adds", f"{forward_us:,.0f} us", ""),
        ("cores one worker keeps busy (its Steps/s / its Steps per bridge CPU-second)", f"{used_1:.2f}", ""),
        (
            "the most Steps/s 2 workers can reach over 1 on these cores at one worker's Steps per CPU-second: "
            "cores / (cores one worker keeps busy x (1 + generator / bridge CPU per Step))",
            f"{bound:.2f}x",
            "bounds the 1.5x above",
        ),
        (
            "CPU ceiling of 2 workers' Steps/s at their own Steps per CPU-second: cores / (bridge + generator CPU "
            "per Step); measured / ceiling",
            f"{ceiling_2:,.0f}; {two.median('steps_per_s') / ceiling_2:.0%}",
            "",
        ),
        (
            "this machine: the same Python work (protobuf, a dict) in 2 processes at once over 1 alone, "
            "work per CPU-second / work per second",
            f"{probe_cpu:.2f} / {probe_tput:.2f}x",
            "",
        ),
        (
            "load generators' CPU per Step, 1 / 2 workers",
            f"{one.median('gen_cpu_us_per_step'):,.0f} / {two.median('gen_cpu_us_per_step'):,.0f} us",
            "",
        ),
    ]
    notes = (
        f"Toy engine, unary 16-token Steps, {inflight} in flight from "
        + (
            "one C++ load-generator process (bench/loadgen/stepgen.cc, 8 connections; the forwarded rounds from "
            f"{generators} Python generators)"
            if generator == "cpp"
            else f"{generators} Python load-generator processes (8 connections each)"
        )
        + f", {seconds:.0f} s windows, {rounds} rounds in rotating order, medians. {cores} cores, "
        f"load average {load:.1f} at the start (other work shares the machine). One worker keeps more than a "
        "core busy (gRPC's threads run beside its event loop), and the generators need CPU per Step too: with "
        "every core busy, Steps/s cannot pass cores / (bridge + generator CPU per Step) (the ceiling row). Unless "
        "2 workers spend less CPU per Step than one, that bounds their Steps/s over one worker's (the bound row) "
        "on this machine whatever the bridge does. The machine row runs one "
        "pure-Python busy loop alone, then two at once (3 rounds of 3 s, no gRPC, no load generator): its "
        "first figure is how much work a CPU-second buys when both cores are busy, against one, on this "
        "machine; the Steps per CPU-second ratio cannot be expected above it."
    )
    if tput > bound * 1.05:
        notes += (
            f" The measured Steps/s ratio ({tput:.2f}x) is above what the cores allow ({bound:.2f}x): "
            "other work held the cores, and two busy worker processes win a larger share of contended CPU from the "
            "scheduler than one; it is not capacity an idle machine would show."
        )
    figures = {
        "steps_per_s_1": one.median("steps_per_s"),
        "steps_per_s_2": two.median("steps_per_s"),
        "steps_per_cpu_s_1": one.median("steps_per_cpu_s"),
        "steps_per_cpu_s_2": two.median("steps_per_cpu_s"),
        "generator_cpu_us_per_step_1": one.median("gen_cpu_us_per_step"),
        "generator_cpu_us_per_step_2": two.median("gen_cpu_us_per_step"),
        "steps_per_s_ratio_rounds": tput_rounds,
        "steps_per_cpu_s_ratio_rounds": eff_rounds,
        "load_average_at_start": load,
        "generator": generator,
        "forwarded_steps_per_s_2": cross.median("steps_per_s"),
        "forwarded_steps_per_cpu_s_2": cross.median("steps_per_cpu_s"),
        "forwarded_step_extra_bridge_cpu_us": forward_us,
        "cores_used_by_one_worker": used_1,
        "steps_per_s_ratio_bound": bound,
        "cpu_ceiling_steps_per_s_2": ceiling_2,
        "machine_two_processes_work_per_cpu_s_ratio": probe_cpu,
        "machine_two_processes_work_per_s_ratio": probe_tput,
    }
    ratios = {"workers2_over_1_steps_per_s": tput, "workers2_over_1_steps_per_cpu_s": eff}
    record("workers", "bridge workers: --workers 2 vs 1", rows, figures, notes, ratios)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of 1 worker, 2, and 2 with every Step forwarded")
    ap.add_argument(
        "--generator",
        choices=("cpp", "python"),
        default="cpp",
        help="cpp: one bench/loadgen/stepgen process; python: --generators grpc.aio processes (2x rounds use these)",
    )
    ap.add_argument("--generators", type=int, default=2, help="Python load-generator processes")
    ap.add_argument("--inflight", type=int, default=64, help="Steps in flight in total")
    args = ap.parse_args()
    main(args.seconds, args.rounds, args.generator, args.generators, args.inflight)
