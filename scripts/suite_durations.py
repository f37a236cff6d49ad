#!/usr/bin/env python3
"""Where the test suite's time goes, from the record ``tests/scheduling.py`` writes after every run.

    python scripts/suite_durations.py                    # bench/out/test_durations.json of the last run
    python scripts/suite_durations.py RECORD --top 10    # the 10 slowest tests
    python scripts/suite_durations.py --write-estimates  # refresh tests/durations.json (the xdist queue order)
    python scripts/suite_durations.py --json             # the summary as JSON

Prints the run's wall time and exit status, the busy time of each worker, the time per module (set-up, call,
tear-down; the set-up column is mostly module- and session-scoped fixtures: a model loaded, a server
started), the time per xdist work unit, and the slowest tests (set-up + call + tear-down).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "out" / "test_durations.json"
ESTIMATES = ROOT / "tests" / "durations.json"


def load(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        sys.exit(f"{path}: no record; run the suite first (make test or make test-fast writes it)")
    except ValueError as exc:
        sys.exit(f"{path}: not a test-durations record ({exc})")
    if not isinstance(record, dict) or not isinstance(record.get("phases"), list):
        sys.exit(f"{path}: not a test-durations record (no 'phases' list)")
    return record


def summarise(record: dict[str, Any], top: int) -> dict[str, Any]:
    modules: dict[str, dict[str, float]] = defaultdict(lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    tests: dict[str, float] = defaultdict(float)
    units: dict[str, float] = defaultdict(float)
    workers: dict[str, float] = defaultdict(float)
    outcomes: dict[str, int] = defaultdict(int)
    for phase in record["phases"]:
        nodeid, when, seconds = phase["nodeid"], phase["when"], float(phase["duration"])
        module = nodeid.split("::", 1)[0]
        modules[module][when] += seconds
        tests[nodeid] += seconds
        units[phase.get("unit") or module] += seconds
        workers[phase.get("worker") or "main"] += seconds
        if when == "call" or (when == "setup" and phase["outcome"] != "passed"):
            outcomes[phase["outcome"]] += 1
    by_module = sorted(
        (
            {"module": m, **{k: round(v, 1) for k, v in t.items()}, "total": round(sum(t.values()), 1)}
            for m, t in modules.items()
        ),
        key=lambda row: -row["total"],
    )
    return {
        "wall_s": record.get("wall_s"),
        "workers": record.get("workers"),
        "exitstatus": record.get("exitstatus"),
        "outcomes": dict(outcomes),
        "busy_s": {w: round(s, 1) for w, s in sorted(workers.items())},
        "modules": by_module,
        "units": {u: round(s, 1) for u, s in sorted(units.items(), key=lambda kv: -kv[1])},
        "slowest": [{"test": t, "seconds": round(s, 1)} for t, s in sorted(tests.items(), key=lambda kv: -kv[1])[:top]],
    }


def print_summary(summary: dict[str, Any], modules: int) -> None:
    counts = ", ".join(f"{n} {o}" for o, n in sorted(summary["outcomes"].items()))
    workers, status = summary["workers"] or 1, summary["exitstatus"]
    print(f"wall {summary['wall_s']} s, {workers} worker(s), exit status {status}: {counts}")
    print("busy time per worker: " + ", ".join(f"{w} {s:.0f} s" for w, s in summary["busy_s"].items()))
    print(f"\n{'module':<62} {'set-up':>8} {'call':>8} {'teardown':>8} {'total':>8}")
    for row in summary["modules"][:modules]:
        print(
            f"{row['module']:<62} {row['setup']:>8.1f} {row['call']:>8.1f} {row['teardown']:>8.1f} {row['total']:>8.1f}"
        )
    rest = summary["modules"][modules:]
    if rest:
        print(f"{f'... {len(rest)} more modules':<62} {'':>8} {'':>8} {'':>8} {sum(r['total'] for r in rest):>8.1f}")
    print(f"\n{'slowest tests (set-up + call + tear-down)':<100} {'s':>7}")
    for row in summary["slowest"]:
        print(f"{row['test'][:100]:<100} {row['seconds']:>7.1f}")


def write_estimates(summary: dict[str, Any]) -> None:
    """The seconds per work unit tests/scheduling.py queues by (longest first); merged, so a partial run
    (make test-fast, one module) updates only the units it ran."""
    try:
        old = json.loads(ESTIMATES.read_text())["units"]
    except (OSError, ValueError, KeyError):
        old = {}
    units = {**old, **summary["units"]}
    doc = {
        "why": "seconds per xdist work unit (tests/scheduling.py) in the last full run, longest first: the order "
        "make test queues them in; python scripts/suite_durations.py --write-estimates refreshes it",
        "units": dict(sorted(units.items(), key=lambda kv: -kv[1])),
    }
    ESTIMATES.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(units)} unit estimates to {ESTIMATES.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", nargs="?", type=Path, default=RECORD, help=f"default {RECORD.relative_to(ROOT)}")
    ap.add_argument("--top", type=int, default=25, help="slowest tests to list (default 25)")
    ap.add_argument("--modules", type=int, default=30, help="modules to list (default 30)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--write-estimates", action="store_true", help=f"update {ESTIMATES.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    summary = summarise(load(args.record), args.top)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_summary(summary, args.modules)
    if args.write_estimates:
        write_estimates(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
