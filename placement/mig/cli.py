"""``primerl placement ...``: plan replicas on a fleet, or show the fleet's inventory.

Exit codes: 0 a plan was made (even one that cannot serve everything: the plan says what
and why), 2 bad input or no fleet description (one line on stderr naming the problem).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import PrimeRLError


def add_placement_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    placement = subparsers.add_parser("placement", help="MIG-aware replica placement and KV budgeting")
    sub = placement.add_subparsers(dest="placement_command", required=True)
    plan = sub.add_parser("plan", help="choose MIG geometries and engine replicas for a demand")
    plan.add_argument("--fleet", metavar="FLEET.yaml", help="fleet file (default: read the local GPUs through NVML)")
    plan.add_argument("--models", metavar="MODELS.yaml", required=True, help="models with their demand")
    plan.add_argument("--solver", choices=("exact", "heuristic"), default="exact", help="ILP (HiGHS) or greedy")
    plan.add_argument("--no-mig", action="store_true", help="whole GPUs only (the baseline)")
    plan.add_argument("--format", choices=("table", "yaml", "json"), default="table", help="what to print")
    plan.add_argument("--output", metavar="FILE", help="also write the full plan here (.json or .yaml)")
    inv = sub.add_parser("inventory", help="show the GPUs and MIG devices (NVML, else the fleet file)")
    inv.add_argument("--fleet", metavar="FLEET.yaml", help="fleet file used when NVML is unavailable")


def run_placement(args: argparse.Namespace) -> int:
    try:
        if args.placement_command == "inventory":
            return _inventory(args)
        return _plan(args)
    except PrimeRLError as exc:
        print(f"primerl placement: {exc.message}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from placement.mig.config import PlannerOptions, load_fleet, load_models
    from placement.mig.inventory import load_inventory
    from placement.mig.plan import Plan
    from placement.mig.problem import build_problem
    from placement.mig.solver import solve

    if args.fleet:
        fleet = load_fleet(args.fleet)
    else:
        fleet, note, _ = load_inventory(None)
        print(note, file=sys.stderr)
    models, archs = load_models(args.models)
    opts = PlannerOptions(solver=args.solver, allow_mig=not args.no_mig)
    prob = build_problem(fleet, models, archs, opts)
    plan = Plan(prob, solve(prob))
    if args.output:
        out = Path(args.output)
        out.write_text(plan.dump("json" if out.suffix == ".json" else "yaml"))
    print(
        plan.table() if args.format == "table" else plan.dump(args.format), end="\n" if args.format == "table" else ""
    )
    return 0


def _inventory(args: argparse.Namespace) -> int:
    from placement.mig.inventory import load_inventory

    fleet, note, records = load_inventory(args.fleet)
    print(note)
    for r in records:
        mig = "MIG on" if r.mig_enabled else "MIG off"
        print(f"GPU {r.index}: {r.name} ({r.gpu_type or 'unknown type'}), {r.total_mib or '?'} MiB, {mig}")
        for d in r.mig_devices:
            print(f"  {d.uuid}: {d.profile or '?'} ({d.compute_slices}g, {d.memory_mib} MiB, start {d.start})")
        if r.remaining:
            print("  can still create: " + ", ".join(f"{n} x{c}" for n, c in sorted(r.remaining.items())))
    for n in fleet.nodes:
        layouts = "; ".join(f"gpu {i}: {'+'.join(lay)}" for i, lay in sorted(n.mig_layouts.items())) or "no MIG layouts"
        print(f"node {n.name}: {n.count} x {n.gpu} ({layouts})")
    return 0
