"""The three-component loop (``primerl rl --trainer @ --orchestrator @ --inference @``), asynchronous against
synchronous, side by side in one run: ``python bench/rl_components.py [--steps 10] [--async-level 2]``.

Both runs are the shipped example (``examples/rl/``: ``make run``'s task and settings) on the embedded engine, the
same steps and seeds; the only difference is ``max_async_level`` (k vs 0). Recorded as ``rl_components``: wall
time of each (bridge start included), the ratio, the share of training steps that overlapped a rollout, the largest
off-policy gap, and the held-out reward (greedy, 30 problems) before and after each run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import record  # noqa: E402

COMPONENTS = [
    "--trainer", "@", "examples/rl/trainer.toml",
    "--orchestrator", "@", "examples/rl/orchestrator.toml",
    "--inference", "@", "examples/rl/inference.toml",
    "--inference.log-level", "WARNING",
]  # fmt: skip


def run(out: Path, steps: int, k: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "server", "rl", *COMPONENTS, "--out-dir", str(out), "--max-steps", str(steps)]
    cmd += ["--max-async-level", str(k)]
    print(f"[rl_components] max_async_level={k}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"the run with max_async_level={k} failed:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    print(proc.stdout[proc.stdout.rfind("\n     step") :], flush=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    overlapped = sum(
        any(t["rollout_start"] < r["train_end"] and r["train_start"] < t["rollout_end"] for t in rows) for r in rows
    )
    report = json.loads((out / "eval.json").read_text())
    return {
        "wall_s": wall,
        "steps": len(rows),
        "overlapped_steps": overlapped,
        "max_gap": max(r["off_policy_gap"] for r in rows),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "held_out_before": report["before"]["reward"],
        "held_out_after": report["after"]["reward"],
        "correct_before": report["before"]["correct"],
        "correct_after": report["after"]["correct"],
        "per_step": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--async-level", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rl_components_") as tmp:
        fast = run(Path(tmp) / "async", args.steps, args.async_level)
        sync = run(Path(tmp) / "sync", args.steps, 0)
    k = args.async_level
    rows = [("wall time, same steps: sync / async", f"{sync['wall_s'] / fast['wall_s']:.2f}x", "> 1")]
    for name, r in ((f"k={k}", fast), ("k=0", sync)):
        rows += [
            (f"{name}: wall time ({r['steps']} steps, bridge start included)", f"{r['wall_s']:.0f} s", ""),
            (f"{name}: training steps that overlapped a rollout", f"{r['overlapped_steps']} / {r['steps']}", ""),
            (f"{name}: largest off-policy gap", str(r["max_gap"]), f"<= {k if r is fast else 0}"),
            (
                f"{name}: held-out reward before -> after (correct)",
                f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f} "
                f"({r['correct_before']:.0%} -> {r['correct_after']:.0%})",
                "rises",
            ),
        ]
    record(
        "rl_components",
        f"primerl rl as three processes (examples/rl/, {args.steps} steps): max_async_level {k} vs 0",
        rows,
        {"async": fast, "sync": sync, "async_level": k},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
