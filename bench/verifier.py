"""Verifier: verdicts graded, signed (Ed25519 DSSE) and appended to the RFC 6962 log per second; proofs per second.

Measured in one run on one machine, with the trivial ``constant`` grader and a 64-token trajectory:
- in process (``Verifier.score`` from 64 concurrent callers, SQLite log, group commit): verdicts/s
  (target >= 1,000), p50/p99 latency of one verdict (grade + sign + durable append + checkpoint);
- over HTTP against ``primerl verifier serve`` in its own process: ``POST /v1/score`` (one verdict per
  request, 32 concurrent clients) and ``POST /v1/score/batch`` (64 per request, 4 clients);
- over gRPC against the same server: ``Score`` (one per call, 32 concurrent) and ``ScoreBatch`` (64 per
  call, 4 clients); the batch APIs are the service-level figure held to the >= 1,000/s target;
- log bytes per entry (SQLite file after a WAL checkpoint, and the leaf alone);
- inclusion proofs/s (in-memory tree, and ``GET /v1/log/proof/inclusion`` over HTTP).

Baseline in the same run: the grader alone (``constant`` on a validated request, no signing or log), so the
cost of signing and logging is visible as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._common import free_port, pct, record
from envhub.graders import get_grader
from verifier.config import VerifierConfig
from verifier.service import ScoreRequest, Verifier
from verifier.statement import VerdictSample

TOKENS = 64


def request_body(i: int) -> dict[str, Any]:
    return {
        "grader": "constant",
        "params": {"value": (i % 10) / 10},
        "trajectory": {
            "episode_id": f"bench-{i}",
            "token_ids": [(i + k) % 49152 for k in range(TOKENS)],
            "logprobs": [None] * 16 + [-0.1 * (k % 7) for k in range(TOKENS - 16)],
            "loss_mask": [0] * 16 + [1] * (TOKENS - 16),
            "origins": [1] * 16 + [3] * (TOKENS - 16),
            "policy_versions": [0] * 16 + [3] * (TOKENS - 16),
        },
    }


async def in_process(n: int, concurrency: int, workdir: Path) -> dict[str, float]:
    config = VerifierConfig(database_url=f"sqlite:///{workdir / 'inproc.sqlite3'}", key_dir=str(workdir / "keys"))
    verifier = await Verifier.open(config)
    reqs = [ScoreRequest.model_validate(request_body(i)) for i in range(n)]
    latencies: list[float] = []

    async def worker(items: list[ScoreRequest]) -> None:
        for r in items:
            t0 = time.perf_counter()
            await verifier.score(r)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(reqs[k::concurrency]) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    size = verifier.log.size
    tree = verifier.log.tree
    picks = [random.Random(k).randrange(size) for k in range(20_000)]
    t1 = time.perf_counter()
    for idx in picks:
        tree.inclusion_proof(idx, size)
    proofs_s = len(picks) / (time.perf_counter() - t1)
    leaf_bytes = sum(len(verifier.log.store.entry(i)[0]) for i in range(0, size, max(1, size // 200)))  # type: ignore[index]
    leaf_samples = len(range(0, size, max(1, size // 200)))
    await verifier.close()
    db = workdir / "inproc.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return {
        "verdicts_per_s": n / elapsed,
        "p50_ms": pct(latencies, 50) * 1e3,
        "p99_ms": pct(latencies, 99) * 1e3,
        "db_bytes_per_entry": db.stat().st_size / size,
        "leaf_bytes": leaf_bytes / leaf_samples,
        "proofs_per_s": proofs_s,
        "tree_size": size,
    }


def grader_only(n: int) -> float:
    grader = get_grader("constant")
    t0 = time.perf_counter()
    for i in range(n):
        r = ScoreRequest.model_validate(request_body(i))
        grader(VerdictSample(r.trajectory, r.params))
    return n / (time.perf_counter() - t0)


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """``primerl verifier serve`` in its own process, on free HTTP and gRPC ports."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "server", "verifier", "serve", "--http-port", str(port), "--grpc-port", str(grpc_port)]
    cmd += ["--database-url", f"sqlite:///{workdir / 'http.sqlite3'}", "--key-dir", str(workdir / "keys")]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=os.environ.copy()), port, grpc_port


def grpc_request(i: int) -> Any:
    from proto.primerl.v1 import primerl_pb2 as pb
    from proto.primerl.v1 import verifier_pb2 as vpb

    body = request_body(i)
    t = body["trajectory"]
    trajectory = pb.Trajectory(
        episode_id=t["episode_id"],
        token_ids=t["token_ids"],
        logprobs=[math.nan if x is None else x for x in t["logprobs"]],
        loss_mask=[bool(x) for x in t["loss_mask"]],
        origins=t["origins"],
        policy_versions=t["policy_versions"],
    )
    return vpb.ScoreRequest(grader="constant", trajectory=trajectory, params_json=json.dumps(body["params"]))


async def over_grpc(n: int, port: int) -> dict[str, float]:
    """``Score`` one per call (32 concurrent) and ``ScoreBatch`` of 64 (4 clients); latency per call."""
    import grpc

    from proto.primerl.v1 import verifier_pb2 as vpb
    from proto.primerl.v1 import verifier_pb2_grpc as vpb_grpc

    reqs = [grpc_request(i) for i in range(n)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = vpb_grpc.VerifierStub(channel)
        single: list[float] = []
        batch: list[float] = []

        async def one(items: list[Any]) -> None:
            for r in items:
                t0 = time.perf_counter()
                await stub.Score(r, timeout=60)
                single.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(reqs[k::32]) for k in range(32)))
        single_s = n / (time.perf_counter() - t0)
        batches = [vpb.ScoreBatchRequest(items=reqs[k : k + 64]) for k in range(0, n, 64)]

        async def batch_client(items: list[Any]) -> None:
            for b in items:
                t0 = time.perf_counter()
                got = await stub.ScoreBatch(b, timeout=60)
                batch.append(time.perf_counter() - t0)
                assert all(r.WhichOneof("outcome") == "scored" for r in got.results)

        t0 = time.perf_counter()
        await asyncio.gather(*(batch_client(batches[k::4]) for k in range(4)))
        batch_s = n / (time.perf_counter() - t0)
    return {
        "single_per_s": single_s,
        "single_p50_ms": pct(single, 50) * 1e3,
        "single_p99_ms": pct(single, 99) * 1e3,
        "batch_per_s": batch_s,
        "batch_p50_ms": pct(batch, 50) * 1e3,
        "batch_p99_ms": pct(batch, 99) * 1e3,
    }


async def over_http(n: int, port: int) -> dict[str, float]:
    bodies = [json.dumps(request_body(i)) for i in range(n)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        for _ in range(300):
            try:
                await client.get("/healthz")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.1)
        single: list[float] = []

        async def one(items: list[str]) -> None:
            for b in items:
                t0 = time.perf_counter()
                r = await client.post("/v1/score", content=b)
                single.append(time.perf_counter() - t0)
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(bodies[k::32]) for k in range(32)))
        single_s = n / (time.perf_counter() - t0)
        batches = ['{"items": [' + ",".join(bodies[k : k + 64]) + "]}" for k in range(0, n, 64)]

        batch_lat: list[float] = []

        async def batch_client(items: list[str]) -> None:
            for b in items:
                t0 = time.perf_counter()
                (await client.post("/v1/score/batch", content=b)).raise_for_status()
                batch_lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(batch_client(batches[k::4]) for k in range(4)))  # 4 clients
        batch_s = n / (time.perf_counter() - t0)
        size = (await client.get("/v1/log/checkpoint")).json()["tree_size"]
        t0 = time.perf_counter()
        m = 2000
        for k in range(m):
            r = await client.get("/v1/log/proof/inclusion", params={"index": k % size, "tree_size": size})
            r.raise_for_status()
        http_proofs_s = m / (time.perf_counter() - t0)
    return {
        "single_per_s": single_s,
        "single_p50_ms": pct(single, 50) * 1e3,
        "single_p99_ms": pct(single, 99) * 1e3,
        "batch_per_s": batch_s,
        "batch_p50_ms": pct(batch_lat, 50) * 1e3,
        "batch_p99_ms": pct(batch_lat, 99) * 1e3,
        "http_proofs_per_s": http_proofs_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="verdicts per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="in-process concurrent callers")
    parser.add_argument("--no-record", action="store_true", help="print only (no RESULTS.md / JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="primerl-verifier-bench-") as tmp:
        work = Path(tmp)
        base = grader_only(args.n)
        inproc = asyncio.run(in_process(args.n, args.concurrency, work))
        proc, port, grpc_port = start_server(work)
        try:
            http = asyncio.run(over_http(args.n, port))
            rpc = asyncio.run(over_grpc(args.n, grpc_port))
        finally:
            proc.terminate()
            proc.wait(30)
    ok = "yes" if inproc["verdicts_per_s"] >= 1000 else "NO"
    service = min(http["batch_per_s"], rpc["batch_per_s"])
    service_ok = "yes" if service >= 1000 else "NO"
    rows = [
        (
            "verdicts/s in process (grade + sign + append, SQLite)",
            f"{inproc['verdicts_per_s']:,.0f}",
            f">= 1,000 ({ok})",
        ),
        ("verdict latency p50 / p99 in process", f"{inproc['p50_ms']:.2f} / {inproc['p99_ms']:.2f} ms", "-"),
        ("grader alone (validate + constant), baseline", f"{base:,.0f}/s", "-"),
        ("verdicts/s over HTTP, 1 per request (32 clients)", f"{http['single_per_s']:,.0f}", "-"),
        ("HTTP latency p50 / p99, 1 per request", f"{http['single_p50_ms']:.2f} / {http['single_p99_ms']:.2f} ms", "-"),
        (
            "verdicts/s over HTTP, /v1/score/batch of 64 (4 clients)",
            f"{http['batch_per_s']:,.0f}",
            f">= 1,000 ({'yes' if http['batch_per_s'] >= 1000 else 'NO'})",
        ),
        (
            "HTTP batch latency p50 / p99 (64 verdicts)",
            f"{http['batch_p50_ms']:.1f} / {http['batch_p99_ms']:.1f} ms",
            "-",
        ),
        ("verdicts/s over gRPC, Score 1 per call (32 concurrent)", f"{rpc['single_per_s']:,.0f}", "-"),
        ("gRPC Score latency p50 / p99", f"{rpc['single_p50_ms']:.2f} / {rpc['single_p99_ms']:.2f} ms", "-"),
        (
            "verdicts/s over gRPC, ScoreBatch of 64 (4 clients)",
            f"{rpc['batch_per_s']:,.0f}",
            f">= 1,000 ({'yes' if rpc['batch_per_s'] >= 1000 else 'NO'})",
        ),
        (
            "gRPC ScoreBatch latency p50 / p99 (64 verdicts)",
            f"{rpc['batch_p50_ms']:.1f} / {rpc['batch_p99_ms']:.1f} ms",
            "-",
        ),
        (
            "service batch verdicts/s over in-process",
            f"{service / inproc['verdicts_per_s']:.2f}x",
            f"service {service_ok}",
        ),
        ("log bytes per entry (SQLite file, WAL checkpointed)", f"{inproc['db_bytes_per_entry']:,.0f}", "-"),
        ("leaf bytes per entry (DSSE envelope JSON)", f"{inproc['leaf_bytes']:,.0f}", "-"),
        (f"inclusion proofs/s (tree of {inproc['tree_size']:,})", f"{inproc['proofs_per_s']:,.0f}", "-"),
        ("inclusion proofs/s over HTTP (1 client)", f"{http['http_proofs_per_s']:,.0f}", "-"),
    ]
    notes = (
        f"{args.n:,} verdicts per measurement, {TOKENS}-token trajectories, grader `constant`; Ed25519 via "
        "`cryptography`; SQLite in WAL mode with synchronous=FULL, one transaction and one signed checkpoint per "
        "batch (group commit). HTTP and gRPC: one `primerl verifier serve` process serving both, the clients in this "
        "one (the same log, so the gRPC figures run on a larger tree)."
    )
    figures = {"in_process": inproc, "http": http, "grpc": rpc, "grader_only_per_s": base}
    if args.no_record:
        print(json.dumps(figures, indent=2))
        return
    record(
        "verifier",
        "Verifier: signed verdicts and log proofs",
        rows,
        figures,
        notes=notes,
        ratios={
            "verifier.verdicts_per_s_over_target": inproc["verdicts_per_s"] / 1000,
            "verifier.service_batch_verdicts_per_s_over_target": service / 1000,
        },
    )


if __name__ == "__main__":
    main()
