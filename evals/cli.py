"""``primerl eval``: registered tasks against checkpoints through a bridge, scores signed into the verifier log.

::

    primerl eval --task calculator --task arith-exact \\
        --checkpoint base=WEIGHTS_DIR --checkpoint trained=OTHER_DIR --engine embedded --out DIR

``--bridge HOST:PORT`` evaluates on a running bridge; without it a bridge (``--engine``, default embedded) is
started for the run and stopped after. The verifier log is ``--database-url`` / ``--key-dir`` (the same
flags and defaults as ``primerl verifier serve``). Exit codes: 0 done; 2 bad input (task file, task name,
checkpoint, a bridge that refused).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from core.errors import PrimeRLError
from engines.launch import free_port
from evals.registry import SHIPPED, load_registry, select
from evals.runner import Checkpoint, format_table, run_eval
from verifier.config import VerifierConfig


def add_eval_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("eval", help="run registered eval tasks against checkpoints; scores are signed verdicts")
    p.add_argument("--registry", default=str(SHIPPED), metavar="FILE", help="task registry YAML (default: shipped)")
    p.add_argument("--task", action="append", default=[], metavar="NAME", help="task to run (repeat; default all)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR", help="weights to evaluate (repeat)")
    p.add_argument("--bridge", metavar="HOST:PORT", help="a running bridge (default: start one with --engine)")
    p.add_argument("--engine", default="embedded", help="engine of the bridge started for the run")
    p.add_argument("--samples", type=int, help="override every task's sample count")
    p.add_argument("--seed", type=int, help="override every task's seed")
    p.add_argument("--concurrency", type=int, default=4, help="episodes in flight")
    p.add_argument("--out", default="eval-out", metavar="DIR", help="samples.jsonl, summary.json, verify/")
    p.add_argument("--database-url", help="verifier log database (sqlite:///PATH or postgresql://...)")
    p.add_argument("--key-dir", help="verifier signing keys")


def run_eval_command(args: argparse.Namespace) -> int:
    try:
        tasks = select(load_registry(args.registry), args.task)
        override = {k: v for k, v in (("samples", args.samples), ("seed", args.seed)) if v is not None}
        tasks = [t.model_validate({**t.model_dump(), **override}) for t in tasks]
        checkpoints = [Checkpoint.parse(c) for c in args.checkpoint] or [Checkpoint("current", "")]
        data = {k: getattr(args, k) for k in ("database_url", "key_dir") if getattr(args, k)}
        config = VerifierConfig.model_validate(data)
        summary = asyncio.run(_run(args, tasks, checkpoints, config))
    except PrimeRLError as exc:
        print(f"primerl eval: {exc.message}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__module__.startswith(("pydantic", "rl_client")):
            print(f"primerl eval: {exc}", file=sys.stderr)
            return 2
        raise
    print(format_table(summary))
    print(f"samples, summary and verify/ material in {args.out}; log {config.database_url}")
    return 0


async def _run(args: argparse.Namespace, tasks: list, checkpoints: list[Checkpoint], config: VerifierConfig) -> dict:
    from rl_client import AsyncBridgeClient
    from verifier.service import Verifier

    async with _bridge(args.bridge, args.engine) as target:
        verifier = await Verifier.open(config)
        try:
            async with AsyncBridgeClient(target, timeout=600) as client:
                await client.wait_until_ready(timeout=900)
                return await run_eval(client, verifier, tasks, checkpoints, Path(args.out), args.concurrency)
        finally:
            await verifier.close()


@contextlib.asynccontextmanager
async def _bridge(target: str | None, engine: str) -> AsyncIterator[str]:
    """``target``, or a bridge started on a free port for the run (stopped after)."""
    if target:
        yield target
        return
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--engine", engine, "--port", str(port), "--metrics-port", "0"]
    env = {**os.environ, "PRIMERL_HTTP__PORT": "0"}
    proc = await asyncio.to_thread(subprocess.Popen, [*cmd, "--log-level", "WARNING"], env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
