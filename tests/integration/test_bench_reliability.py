"""The reliability benches run end to end (issue 25): a short soak and a short chaos run, nothing recorded.

Correctness only: every episode finishes without an error and the reports carry their figures; the figures
themselves (RSS slope, p99, kill counts) come from the full runs recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_soak_smoke() -> None:
    stdout = _run(
        "bench/soak.py", "--episodes", "40", "--minutes", "0.25", "--turns", "2", "--sample-s", "1",
        "--window-s", "2", "--no-record", timeout=180,
    )  # fmt: skip
    assert "bound stated before the run" in stdout.splitlines()[0]
    report = json.loads(next(line for line in stdout.splitlines() if line.startswith("SOAK ")).removeprefix("SOAK "))
    assert report["errors"] == 0, report["first_errors"]
    assert report["episodes_completed"] >= 40 and report["steps"] == 2 * report["episodes_completed"]
    assert len(report["rss_samples_mib"]) >= 5 and len(report["rss_minima_mib"]) >= 2
    assert report["p99_ms_per_minute"]


def test_chaos_smoke() -> None:
    stdout = _run(
        "bench/chaos.py", "--episodes", "6", "--concurrency", "3", "--turns", "2", "--max-tokens", "60",
        "--horizon-s", "30", "--seed", "3", "--no-record", timeout=240,
    )  # fmt: skip
    planned = re.findall(r"t=\s*[\d.]+ s  kill    r\d, restart", stdout)
    assert planned, stdout  # the seeded schedule is printed before the run
    assert "('lost tokens (streamed, not in the trajectory at their place)', '0', '0')" in stdout, stdout
    assert "('episodes whose trajectory is exactly what was streamed', '6', '6')" in stdout, stdout
    # The first kill is planned before the episodes (2 turns of 60 tokens at 10 ms a token, 3 at a time) can end.
    kills = re.search(r"'SIGKILLs executed \(3 replicas, each restarted\)', '(\d+) in", stdout)
    assert kills and int(kills.group(1)) >= 1, stdout
