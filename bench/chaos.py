"""Chaos: episodes through a bridge while its engine processes are SIGKILLed and restarted on a seeded schedule.

Three stand-in engine servers (SGLang wire format over the toy engine, ``tests/standins/serve.py``) run as their
own processes behind one bridge. A schedule drawn from ``--seed`` (printed before anything runs) SIGKILLs a live
replica every few seconds and restarts it on the same port after a seeded downtime; at least one replica is always
left alive. Meanwhile ``--episodes`` episodes (``--concurrency`` at a time) each stream ``--turns`` turns.

The client keeps what it was streamed: every token id and logprob of every turn, the partial ones of a turn whose
replica died included (the Step then fails UNAVAILABLE and the episode goes on with its next turn on another
replica). At the end each trajectory is compared with that record: the prompt, each observation and each turn's
tokens at the positions the trajectory's turn table gives, ids and logprobs exactly. A *lost token* is one the
client was streamed that the trajectory does not hold at its place (target: 0). Tokens the trajectory holds past
what the client saw of a failed turn are counted as well (they are kept, not lost; the client never saw them).

Usage: python bench/chaos.py [--seed 0] [--episodes 200] [--replicas 3] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from bench._common import free_port, record
from core.types import ModelFacts
from engines.config import SglangConfig, ToyConfig
from engines.http.sglang import SglangEngine
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient
from rl_client.errors import FailedPreconditionError, UnavailableError
from server.app import create_server
from server.config import load_settings
from tests.standins.serve import StandinProcess

PROMPT = [1, 4, 30, 31, 32, 2, 5]


@dataclass
class Turn:
    observation: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cut: bool = False  # the Step failed UNAVAILABLE (its replica died) after these tokens


@dataclass
class Tally:
    episodes_exact: int = 0
    episodes_failed: list[str] = field(default_factory=list)
    lost_tokens: int = 0
    unseen_kept_tokens: int = 0
    streamed_tokens: int = 0
    steps_cut: int = 0
    steps_refused: int = 0  # failed before any token (no replica up): retried


def schedule(seed: int, replicas: int, horizon_s: float) -> list[tuple[float, int, float]]:
    """(time, replica, downtime) of each SIGKILL, seeded: one every 0.8-2.5 s, down for 0.5-2 s, and a replica
    is killed only while another one is up."""
    rng = random.Random(seed)
    kills: list[tuple[float, int, float]] = []
    back_at = [0.0] * replicas
    t = rng.uniform(0.5, 1.5)
    while t < horizon_s:
        live = [r for r in range(replicas) if back_at[r] <= t]
        if len(live) >= 2:
            victim, down = rng.choice(live), rng.uniform(0.5, 2.0)
            back_at[victim] = t + down
            kills.append((t, victim, down))
        t += rng.uniform(0.8, 2.5)
    return kills


async def run_schedule(kills: list[tuple[float, int, float]], procs: list[StandinProcess], done: asyncio.Event) -> int:
    """Kill at the planned times; each restart (as long as a process takes to start) runs on its own, so it does
    not delay the next kill. A kill whose replica is still down, that would leave none alive, or that comes after
    the episodes ended is skipped."""
    t0, executed = time.perf_counter(), 0
    down: set[int] = set()
    restarts: list[asyncio.Task[None]] = []

    def say(what: str, r: int) -> None:
        print(f"  t={time.perf_counter() - t0:6.2f} s  {what:7s} r{r} (pid {procs[r].pid})", flush=True)

    async def restart(r: int, after: float) -> None:
        await asyncio.sleep(after)
        await asyncio.to_thread(procs[r].restart)
        down.discard(r)
        say("restart", r)

    for at, r, downtime in kills:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, at - (time.perf_counter() - t0)))
        if done.is_set():
            break
        if r in down or len(down) + 1 >= len(procs):
            continue
        procs[r].kill()
        down.add(r)
        executed += 1
        say("kill", r)
        restarts.append(asyncio.create_task(restart(r, downtime)))
    await asyncio.gather(*restarts)
    return executed


async def stream_turn(client: AsyncBridgeClient, ep: str, turn: Turn, sampling: dict[str, Any], tally: Tally) -> None:
    """One Step. UNAVAILABLE (the replica died, or none was up) ends the turn as cut: the bridge keeps it, with
    its observation and partial tokens. FAILED_PRECONDITION (the episode still busy) recorded nothing: retried."""
    while True:
        try:
            async for chunk in client.stream_step(ep, turn.observation or None, sampling=sampling):
                turn.ids += chunk.token_ids
                turn.logprobs += chunk.logprobs
                if chunk.done is not None:
                    return
            return
        except UnavailableError:
            turn.cut = True
            tally.steps_cut += bool(turn.ids)
            tally.steps_refused += not turn.ids
            return
        except FailedPreconditionError:
            assert not turn.ids, "FAILED_PRECONDITION mid-stream"
            await asyncio.sleep(0.05)


async def end(client: AsyncBridgeClient, ep: str) -> Any:
    for _ in range(200):  # a failed Step may still be winding down on the bridge: the episode is busy until then
        try:
            return await client.end_episode(ep, reward=1.0)
        except FailedPreconditionError:
            await asyncio.sleep(0.05)
    return await client.end_episode(ep, reward=1.0)


def compare(traj: Any, turns: list[Turn], tally: Tally) -> str:
    """Empty when the trajectory holds exactly what was streamed; else what differs. Counts lost tokens."""
    ids, lps = traj.token_ids.tolist(), traj.logprobs
    problems = [] if ids[: len(PROMPT)] == PROMPT else ["prompt differs"]
    if len(traj.turns) != len(turns):
        problems.append(f"{len(traj.turns)} turns in the trajectory, {len(turns)} streamed")
    for k, turn in enumerate(turns):
        tally.streamed_tokens += len(turn.ids)
        if k >= len(traj.turns):
            tally.lost_tokens += len(turn.ids)
            continue
        info = traj.turns[k]
        if ids[info.observation_start : info.generation_start] != turn.observation:
            problems.append(f"turn {k}: observation differs")
        got_ids = ids[info.generation_start : info.end]
        got_lps = lps[info.generation_start : info.end]
        n = len(turn.ids)
        same = [
            i < len(got_ids) and got_ids[i] == turn.ids[i] and np.float32(got_lps[i]) == np.float32(turn.logprobs[i])
            for i in range(n)
        ]
        tally.lost_tokens += same.count(False)
        if not all(same):
            problems.append(f"turn {k}: {same.count(False)} of {n} streamed tokens not in the trajectory")
        if len(got_ids) > n:
            if not turn.cut:
                problems.append(f"turn {k}: {len(got_ids) - n} tokens the client never saw in a completed turn")
            tally.unseen_kept_tokens += len(got_ids) - n
    return "; ".join(problems)


async def episode(client: AsyncBridgeClient, i: int, args: argparse.Namespace, tally: Tally) -> None:
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "seed": args.seed * 100_000 + i}
    while True:
        try:
            ep = (await client.start_episode(PROMPT, sampling=sampling)).episode_id
            break
        except UnavailableError:
            await asyncio.sleep(0.2)
    turns: list[Turn] = []
    for t in range(args.turns):
        turns.append(Turn([] if t == 0 else [2, 4, 40 + t, 41, 2, 5]))
        await stream_turn(client, ep, turns[-1], sampling, tally)
        while turns[-1].cut:  # continue the cut turn (no observation) until one completes
            await asyncio.sleep(0.1)
            turns.append(Turn([]))
            await stream_turn(client, ep, turns[-1], sampling, tally)
    problem = compare(await end(client, ep), turns, tally)
    if problem:
        tally.episodes_failed.append(f"episode {i}: {problem}")
    else:
        tally.episodes_exact += 1


def adapter(url: str, replica: str) -> SglangEngine:
    toy = ToyEngine(ToyConfig())  # what the processes serve: facts and tokenizer
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    config = SglangConfig.model_validate({"connect_retries": 0, "control_timeout_s": 2.0})
    return SglangEngine(url, config, facts, model="toy", tokenizer=toy.tokenizer, request_timeout_s=30, replica=replica)


async def run(args: argparse.Namespace, kills: list[tuple[float, int, float]]) -> tuple[Tally, int, float]:
    procs = [StandinProcess("sglang", free_port(), "--token-delay-s", str(args.token_delay_s))
             for _ in range(args.replicas)]  # fmt: skip
    tally = Tally()
    try:
        for p in procs:
            await asyncio.to_thread(p.start)
        settings = load_settings(
            server={"port": 0, "grace_period_s": 1.0},
            metrics={"port": 0, "health_interval_s": 0.5},
            http={"port": 0},  # the HTTP front door stays off
        )
        server = await create_server(settings, engines=[adapter(p.url, f"r{i}") for i, p in enumerate(procs)])
        await server.start()
        client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=120)
        done = asyncio.Event()
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with gate:
                await episode(client, i, args, tally)

        t0 = time.perf_counter()
        chaos = asyncio.create_task(run_schedule(kills, procs, done))
        await asyncio.gather(*(one(i) for i in range(args.episodes)))
        elapsed = time.perf_counter() - t0
        done.set()
        executed = await chaos
        await client.close()
        await server.stop(0.5)
    finally:
        for p in procs:
            p.stop()
    return tally, executed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--token-delay-s", type=float, default=0.01, help="stand-ins: time per generated token")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--horizon-s", type=float, default=300.0, help="kills are scheduled over this long")
    parser.add_argument("--no-record", action="store_true", help="print only: no RESULTS.md entry")
    args = parser.parse_args()

    kills = schedule(args.seed, args.replicas, args.horizon_s)
    print(f"chaos seed {args.seed}: {args.episodes} episodes x {args.turns} turns over {args.replicas} stand-in "
          f"processes; kill schedule (SIGKILL, restart on the same port), stopped when the episodes end:")  # fmt: skip
    for at, r, down in kills:
        print(f"  t={at:6.2f} s  kill    r{r}, restart {down:.2f} s later")
    print("executed:", flush=True)
    tally, executed, elapsed = asyncio.run(run(args, kills))
    for line in tally.episodes_failed[:10]:
        print("  " + line)
    rows = [
        (f"episodes ({args.turns} streamed turns each), seed {args.seed}", f"{args.episodes}", ""),
        ("episodes whose trajectory is exactly what was streamed", f"{tally.episodes_exact}", f"{args.episodes}"),
        ("lost tokens (streamed, not in the trajectory at their place)", f"{tally.lost_tokens}", "0"),
        (
            "tokens streamed / kept past what the client saw of a cut turn",
            f"{tally.streamed_tokens} / {tally.unseen_kept_tokens}",
            "",
        ),
        (f"SIGKILLs executed ({args.replicas} replicas, each restarted)", f"{executed} in {elapsed:.0f} s", ""),
        (
            "Steps cut mid-stream (UNAVAILABLE, partial tokens) / refused before any token",
            f"{tally.steps_cut} / {tally.steps_refused}",
            "",
        ),
    ]
    figures = {**{k: v for k, v in vars(tally).items() if k != "episodes_failed"}, "kills": executed, "seed": args.seed}
    figures["failures"] = tally.episodes_failed[:20]
    if args.no_record:
        print(rows)
        return
    record(
        "chaos",
        "Chaos: engine processes SIGKILLed and restarted under streaming episodes",
        rows,
        figures,
        "Stand-in SGLang servers over the toy engine, each its own process; bridge and client in one process. "
        "Schedule and episodes are seeded; which turn a kill cuts depends on timing.",
        ratios={"lost_tokens": tally.lost_tokens},
    )


if __name__ == "__main__":
    main()
