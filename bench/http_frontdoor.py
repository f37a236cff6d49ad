"""HTTP front door overhead: a turn through ``POST /inference/v1/generate`` vs the same toy engine in-process
and vs a gRPC Step on the same bridge process.

Measured in one run on one machine, as differences/ratios against baselines taken in the same run:
- p50/p99 added latency of a non-streamed 16-token turn through HTTP over the engine called in-process
  (target <= 1.5 ms p50), and over a gRPC Step on the same bridge;
- added time per streamed token (SSE ``/v1/completions``), as the marginal cost of a token: the slope between
  16- and 256-token streamed calls minus the engine's own slope in-process (target <= 50 us);
- sessions/s with 64 concurrent sessions, each a 3-turn rollout shaped like verifiers' (every turn resends the
  whole history with its ``X-Session-ID``; the bridge appends only the new ids).

A timed turn is a session's second turn: its first call (untimed) opens the session, the second sends the
first turn's prompt + completion + one new id, exactly what a verifiers rollout sends on turn 2. The gRPC
baseline does the same (StartEpisode and a first Step untimed, then a Step with one new id). The client is an
``httpx.AsyncClient`` (what the OpenAI SDK and verifiers use) in this process; the bridge is its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._common import free_port, pct, record, start_bridge
from bench.bridge_overhead import cpu_seconds
from core.types import GenerateRequest, SamplingParams
from engines.config import ToyConfig
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient

PROMPT = [1, 4, 30, 31, 32, 2, 5]
NEW_ID = 9
END_BIAS = -60.0  # the toy engine (here and in the bridge) practically never ends a turn early
SESSION_TURNS = 3


def sampling(tokens: int) -> dict[str, Any]:
    """The bridge's sampling fields (gRPC); the token route adds vLLM's ``logprobs: 1``, as verifiers does."""
    return {"max_tokens": tokens, "ignore_eos": True, "seed": 1, "temperature": 1.0}


async def direct(n: int, tokens: int) -> list[float]:
    engine = ToyEngine(ToyConfig(end_bias=END_BIAS))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=1)
    history = [*PROMPT, *range(40, 40 + 16), NEW_ID]  # a turn-2 history, as the bridge's engine sees it
    out = []
    for i in range(n):
        start = time.perf_counter()
        async for _ in engine.generate(GenerateRequest(str(i), tuple(history), params)):
            pass
        out.append(time.perf_counter() - start)
    return out


class Http:
    """The front door's token and completions routes, as a client sees them."""

    def __init__(self, base: str, model: str) -> None:
        self.base = base
        self.model = model
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(base_url=base, timeout=60.0, limits=limits, trust_env=False)

    async def generate(self, session: str, ids: list[int], tokens: int = 16) -> list[int]:
        body = {"model": self.model, "token_ids": ids, "sampling_params": {**sampling(tokens), "logprobs": 1}}
        r = await self.client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": session})
        if r.status_code != 200:
            raise RuntimeError(f"/inference/v1/generate -> {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        return list(choice["token_ids"])

    async def stream(self, tokens: int) -> int:
        """One SSE /v1/completions call (a one-call session); returns the number of tokens streamed."""
        body = {"model": self.model, "prompt": PROMPT, "stream": True, "return_token_ids": True, **sampling(tokens)}
        n = 0
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/v1/completions -> {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    n += len(choice.get("token_ids") or [])
        return n

    async def close(self) -> None:
        await self.client.aclose()


async def http_turns(http: Http, n: int) -> list[float]:
    out = []
    for _ in range(n):
        session = uuid.uuid4().hex
        first = await http.generate(session, PROMPT)
        history = [*PROMPT, *first, NEW_ID]
        start = time.perf_counter()
        await http.generate(session, history)
        out.append(time.perf_counter() - start)
    return out


async def grpc_turns(client: AsyncBridgeClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        ep = (await client.start_episode(PROMPT, sampling=sampling(16))).episode_id
        await client.step(ep)
        start = time.perf_counter()
        await client.step(ep, [NEW_ID])
        out.append(time.perf_counter() - start)
        await client.discard_episode(ep)
    return out


async def streamed(http: Http, n: int, tokens: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        got = await http.stream(tokens)
        out.append(time.perf_counter() - start)
        if got != tokens:
            raise RuntimeError(f"streamed {got} tokens, asked for {tokens}")
    return out


async def sessions_per_s(http: Http, concurrency: int, seconds: float, pid: int) -> tuple[float, float, float]:
    """(sessions/s, turns/s, bridge CPU-seconds per turn) with ``concurrency`` sessions in flight, each a
    ``SESSION_TURNS``-turn rollout resending its whole history every turn."""
    sessions = turns = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal sessions, turns
        while time.perf_counter() < stop:
            sid = uuid.uuid4().hex
            history = list(PROMPT)
            for _ in range(SESSION_TURNS):
                history += [*await http.generate(sid, history), NEW_ID]
                turns += 1
            sessions += 1

    cpu0, start = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
    return sessions / elapsed, turns / elapsed, cpu / max(turns, 1)


async def wait_http(base: str, timeout_s: float = 60.0) -> str:
    """Poll ``GET /v1/models`` until the front door answers; returns the served model id."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=2.0, trust_env=False) as client:
        while True:
            try:
                r = await client.get("/v1/models")
                if r.status_code == 200:
                    return str(r.json()["data"][0]["id"])
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no HTTP front door at {base} after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


async def main(n: int, seconds: float, concurrency: int, save: bool) -> dict[str, float]:
    base16 = await direct(n, 16)
    stream_n = max(20, n // 10)
    base256 = await direct(stream_n, 256)
    direct_s16 = await direct(stream_n, 16)
    http_port = free_port()
    proc, port = start_bridge(
        "--engine", "toy", "--http-port", str(http_port), env={"PRIMERL_ENGINE__TOY__END_BIAS": str(END_BIAS)}
    )
    try:
        base = f"http://127.0.0.1:{http_port}"
        async with AsyncBridgeClient(f"127.0.0.1:{port}") as client:
            await client.wait_until_ready(60)
            model = await wait_http(base)
            http = Http(base, model)
            try:
                await http_turns(http, 20)  # warm-up
                await grpc_turns(client, 20)
                http16 = await http_turns(http, n)
                grpc16 = await grpc_turns(client, n)
                await streamed(http, 5, 16)
                s16 = await streamed(http, stream_n, 16)
                s256 = await streamed(http, stream_n, 256)
                per_s, turns_per_s, cpu_per_turn = await sessions_per_s(http, concurrency, seconds, proc.pid)
            finally:
                await http.close()
    finally:
        proc.terminate()
        proc.wait(30)
    added_p50 = (pct(http16, 50) - pct(base16, 50)) * 1e3
    added_p99 = (pct(http16, 99) - pct(base16, 99)) * 1e3
    over_grpc_p50 = (pct(http16, 50) - pct(grpc16, 50)) * 1e3
    http_slope = (pct(s256, 50) - pct(s16, 50)) / 240
    engine_slope = (pct(base256, 50) - pct(direct_s16, 50)) / 240
    per_token = (http_slope - engine_slope) * 1e6
    rows = [
        ("in-process 16-token turn p50", f"{pct(base16, 50) * 1e3:.3f} ms", "baseline"),
        ("gRPC 16-token Step p50 / p99", f"{pct(grpc16, 50) * 1e3:.3f} / {pct(grpc16, 99) * 1e3:.3f} ms", ""),
        ("HTTP 16-token turn p50 / p99", f"{pct(http16, 50) * 1e3:.3f} / {pct(http16, 99) * 1e3:.3f} ms", ""),
        ("HTTP added over in-process p50 / p99", f"{added_p50:.3f} / {added_p99:.3f} ms", "<= 1.5 ms p50"),
        ("HTTP added over gRPC Step p50", f"{over_grpc_p50:.3f} ms", ""),
        (
            "streamed call p50, 16 / 256 tokens (SSE /v1/completions)",
            f"{pct(s16, 50) * 1e3:.3f} / {pct(s256, 50) * 1e3:.3f} ms",
            "",
        ),
        ("added time per streamed token (marginal)", f"{per_token:.1f} us", "<= 50 us"),
        (
            f"sessions/s, {concurrency} concurrent {SESSION_TURNS}-turn sessions (turns/s)",
            f"{per_s:,.0f} ({turns_per_s:,.0f})",
            "",
        ),
        ("bridge CPU per HTTP turn under load", f"{cpu_per_turn * 1e6:,.0f} us", ""),
    ]
    figures = {
        "added_ms_p50": added_p50,
        "added_ms_p99": added_p99,
        "added_over_grpc_ms_p50": over_grpc_p50,
        "added_us_per_streamed_token": per_token,
        "sessions_per_s_64": per_s,
        "turns_per_s_64": turns_per_s,
        "bridge_cpu_us_per_http_turn": cpu_per_turn * 1e6,
        "http_ms_p50": pct(http16, 50) * 1e3,
        "grpc_ms_p50": pct(grpc16, 50) * 1e3,
        "direct_ms_p50": pct(base16, 50) * 1e3,
    }
    ratios = {
        "http_over_direct_p50": pct(http16, 50) / pct(base16, 50),
        "http_over_grpc_p50": pct(http16, 50) / pct(grpc16, 50),
        "http_over_direct_256_tokens_streamed_p50": pct(s256, 50) / pct(base256, 50),
    }
    notes = (
        "Bridge (toy engine) in its own process with gRPC and HTTP on the same core; httpx client in another. "
        "A timed turn is a session's turn 2 (history resent, one new id appended), as verifiers sends it. "
        "Per streamed token: (HTTP 256-token - 16-token streamed p50) / 240 minus the engine's own slope."
    )
    if save:
        record("http_frontdoor", "HTTP front door overhead (toy engine)", rows, figures, notes=notes, ratios=ratios)
    else:
        print("\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=500, help="turns per latency measurement")
    ap.add_argument("--seconds", type=float, default=10.0, help="duration of the sessions/s phase")
    ap.add_argument("--concurrency", type=int, default=64, help="sessions in flight in the sessions/s phase")
    ap.add_argument(
        "--no-record", action="store_true", help="print the table only (no bench/results JSON, no RESULTS.md)"
    )
    args = ap.parse_args()
    asyncio.run(main(args.turns, args.seconds, args.concurrency, not args.no_record))
