"""Helpers shared by the benchmarks: machine description, percentiles, RESULTS.md / JSON output."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.launch import free_port

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "RESULTS.md"
RESULTS_JSON = BENCH / "results"  # latest run of each benchmark, committed: RESULTS.md is generated from it


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def start_bridge(
    *args: str, env: dict[str, str] | None = None, tree: Path | None = None, main: tuple[str, ...] = ("-m", "server")
) -> tuple[subprocess.Popen[bytes], int]:
    """A bridge process on a free port (``env``: extra PRIMERL_* settings; ``tree``: run the code of another
    checkout, e.g. an earlier revision, with this venv; ``main``: what runs ``primerl``'s command line, e.g. a
    benchmark that patches the bridge first); returns it and the port."""
    port = free_port()
    cmd = [
        sys.executable,
        *main,
        "serve",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--log-level",
        "WARNING",
    ]
    # The HTTP front door stays off unless asked for (--http-port): two bench bridges must not race for port 8000.
    env = {"PRIMERL_HTTP__PORT": "0", **os.environ, **(env or {})}
    return subprocess.Popen([*cmd, *args], cwd=tree or BENCH.parent, env=env), port


def stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every process, give each ``grace_s`` to exit, then kill what is left."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        if proc.poll() is None:
            proc.kill()


def record(
    name: str,
    title: str,
    rows: list[tuple[str, str, str]],
    figures: dict[str, Any],
    notes: str = "",
    ratios: dict[str, float] | None = None,
    plots: tuple[str, ...] = (),
) -> None:
    """Print a table, write it as JSON to ``bench/results/<name>.json``, append it to the run log in RESULTS.md and
    regenerate RESULTS.md's summary (``bench/report.py``).

    ``ratios`` are the figures measured against a baseline taken in the same run (bridge vs direct engine, stateful
    vs stateless, speculation on vs off, cache-aware vs round-robin): the ones ``bench/gate.py`` compares across
    machines. ``plots`` are paths relative to ``bench/`` of PNGs this run drew.
    """
    stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [f"### {title} — {stamp}", "", f"Machine: {machine()}", "", "| figure | value | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if notes:
        lines += ["", notes]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    payload = {
        "benchmark": name,
        "title": title,
        "date": stamp,
        "machine": machine(),
        "unix_time": time.time(),
        "rows": [list(r) for r in rows],
        "notes": notes,
        "ratios": ratios or {},
        "plots": list(plots),
        "figures": figures,
    }
    RESULTS_JSON.mkdir(exist_ok=True)
    (RESULTS_JSON / f"{name}.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    from bench import report

    report.append_run(text)
    report.regenerate()
