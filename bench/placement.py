"""MIG placement: heuristic vs ILP optimality gap, solve times, and gain over whole-GPU placement.

Measured in one run on this machine (no GPU is needed: the placer is pure planning):
- optimality gap of the heuristic against the exact ILP (HiGHS) on N random small instances
  (target: within 2%), with both solvers' solve times;
- a 1,024-GPU fleet (three GPU types, 40 models) planned by the heuristic (build + solve, median
  of ``RUNS`` runs, each in a fresh catalog cache; target <= 1 s), at the generated demand and at
  20x that demand (saturated), against the ILP with a time limit; the process CPU time of the same
  runs is printed beside the wall clock (the machine is shared, so the wall clock may wait);
- mixed small-model demand (24 models of 0.5-8B, 1,500 tok/s each, on 8 H100s): served demand
  with MIG vs the best whole-GPU placement (the ILP restricted to whole GPUs), and GPUs needed
  to serve 8 such models.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import placement_scenarios as scenarios
from bench._common import pct, record
from placement.mig.catalog import maximal_layouts
from placement.mig.config import ModelsFile, PlannerOptions
from placement.mig.heuristic import solve_heuristic
from placement.mig.problem import Solution, build_problem
from placement.mig.solver import solve_exact

RUNS = 5  # timed plans of the 1,024-GPU fleet; the median is the figure


def gap_study(n: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    gaps: list[float] = []
    t_exact: list[float] = []
    t_heur: list[float] = []
    for _ in range(n):
        fleet, models, archs = scenarios.random_small(rng)
        prob = build_problem(fleet, models, archs, PlannerOptions())
        t0 = time.perf_counter()
        exact = solve_exact(prob)
        t1 = time.perf_counter()
        heur = solve_heuristic(prob)
        t2 = time.perf_counter()
        t_exact.append(t1 - t0)
        t_heur.append(t2 - t1)
        gaps.append(1 - heur.value / exact.value if exact.value else 0.0)
    return {
        "instances": n,
        "gap_mean": sum(gaps) / n,
        "gap_max": max(gaps),
        "within_2pct": sum(g <= 0.02 for g in gaps),
        "exact_ms_p50": pct(t_exact, 50) * 1e3,
        "exact_ms_p99": pct(t_exact, 99) * 1e3,
        "heur_ms_p50": pct(t_heur, 50) * 1e3,
        "heur_ms_p99": pct(t_heur, 99) * 1e3,
    }


def large(scale: float, exact_limit_s: float) -> dict[str, float]:
    fleet, models, archs = scenarios.large_fleet()
    if scale != 1:
        scaled = [
            m.model_copy(update={"demand": m.demand.model_copy(update={"tokens_per_s": m.demand.tokens_per_s * scale})})
            for m in models.models
        ]
        models = ModelsFile(models=scaled)
    walls: list[float] = []
    cpus: list[float] = []
    plans: set[tuple[float, int, int]] = set()
    for _ in range(RUNS):
        maximal_layouts.cache_clear()  # every run pays the catalog work a fresh process would
        t0, c0 = time.perf_counter(), time.process_time()
        heur = solve_heuristic(build_problem(fleet, models, archs, PlannerOptions()))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        plans.add((heur.value, heur.gpus_used, len(heur.replicas)))
    assert len(plans) == 1, f"the heuristic is deterministic, got {plans}"
    out = {
        "gpus": fleet.gpu_count,
        "runs": RUNS,
        "heur_s": statistics.median(walls),
        "heur_s_min": min(walls),
        "heur_s_max": max(walls),
        "heur_cpu_s": statistics.median(cpus),
        "heur_value": heur.value,
        "heur_served": heur.served_fraction,
        "heur_gpus_used": heur.gpus_used,
        "replicas": len(heur.replicas),
    }
    if exact_limit_s > 0:
        t0 = time.perf_counter()
        exact = solve_exact(build_problem(fleet, models, archs, PlannerOptions(time_limit_s=exact_limit_s)))
        out |= {
            "exact_s": time.perf_counter() - t0,
            "exact_optimal": float(exact.status == "optimal"),
            "exact_gpus_used": exact.gpus_used,
            "gap_vs_exact": 1 - heur.value / exact.value,
        }
    return out


def mig_gain() -> dict[str, float]:
    fleet, models, archs = scenarios.mixed_small_models(gpus=8, models=24)
    res: dict[str, Solution] = {
        "mig_exact": solve_exact(build_problem(fleet, models, archs, PlannerOptions())),
        "mig_heur": solve_heuristic(build_problem(fleet, models, archs, PlannerOptions(solver="heuristic"))),
        "whole": solve_exact(build_problem(fleet, models, archs, PlannerOptions(allow_mig=False))),
    }
    f8, m8, a8 = scenarios.mixed_small_models(gpus=8, models=8)
    need_mig = solve_exact(build_problem(f8, m8, a8, PlannerOptions())).gpus_used
    need_whole = solve_exact(build_problem(f8, m8, a8, PlannerOptions(allow_mig=False))).gpus_used
    return {
        **{f"{k}_served": v.served_fraction for k, v in res.items()},
        **{f"{k}_tps": sum(v.served.values()) for k, v in res.items()},
        "gpus_for_8_models_mig": need_mig,
        "gpus_for_8_models_whole": need_whole,
    }


def main(n: int, exact_limit_s: float) -> None:
    g = gap_study(n, seed=0)
    big = large(1, exact_limit_s)
    sat = large(20, exact_limit_s)
    gain = mig_gain()
    rows = [
        (f"heuristic gap vs ILP, {n} random instances", f"mean {g['gap_mean']:.3%}, max {g['gap_max']:.2%}", "<= 2%"),
        ("instances within 2%", f"{g['within_2pct']:.0f}/{n}", f"{n}/{n}"),
        ("ILP solve p50 / p99", f"{g['exact_ms_p50']:.1f} / {g['exact_ms_p99']:.1f} ms", ""),
        ("heuristic solve p50 / p99", f"{g['heur_ms_p50']:.1f} / {g['heur_ms_p99']:.1f} ms", ""),
        (
            f"1,024-GPU fleet, heuristic (build + solve), median of {RUNS}",
            f"{big['heur_s']:.3f} s (min {big['heur_s_min']:.3f}, max {big['heur_s_max']:.3f}; "
            f"CPU {big['heur_cpu_s']:.3f} s), {big['heur_served']:.1%} served, {big['heur_gpus_used']:.0f} GPUs",
            "<= 1 s",
        ),
        (
            f"1,024-GPU fleet, 20x demand (saturated), median of {RUNS}",
            f"{sat['heur_s']:.3f} s (min {sat['heur_s_min']:.3f}, max {sat['heur_s_max']:.3f}; "
            f"CPU {sat['heur_cpu_s']:.3f} s), {sat['heur_served']:.1%} served, {sat['replicas']:.0f} replicas",
            "<= 1 s",
        ),
    ]
    if exact_limit_s > 0:
        for name, r in (("", big), (", 20x", sat)):
            status = "optimal" if r["exact_optimal"] else f"time limit {exact_limit_s:g} s/stage"
            gpus = f"GPUs {r['heur_gpus_used']:.0f} vs {r['exact_gpus_used']:.0f}"
            rows.append(
                (
                    f"1,024 GPUs{name}: ILP ({status})",
                    f"{r['exact_s']:.1f} s; heuristic gap {r['gap_vs_exact']:.2%}, {gpus}",
                    "",
                )
            )
    rows += [
        (
            "24 small models x 1,500 tok/s on 8 H100: served",
            f"MIG ILP {gain['mig_exact_served']:.0%}, MIG heuristic {gain['mig_heur_served']:.0%}, "
            f"whole-GPU {gain['whole_served']:.0%}",
            "MIG > whole",
        ),
        (
            "gain vs whole-GPU placement",
            f"{gain['mig_exact_tps'] / gain['whole_tps']:.2f}x (ILP), "
            f"{gain['mig_heur_tps'] / gain['whole_tps']:.2f}x (heuristic)",
            "",
        ),
        (
            "GPUs to serve 8 small models fully",
            f"MIG {gain['gpus_for_8_models_mig']:.0f} vs whole-GPU {gain['gpus_for_8_models_whole']:.0f}",
            "",
        ),
    ]
    record(
        "placement",
        "MIG placement: heuristic vs ILP, solve times, gain over whole GPUs",
        rows,
        {"gap": g, "large": big, "large_saturated": sat, "mig_gain": gain},
        notes=(
            "Planning only (analytical throughput model, docs/placement.md); the whole-GPU baseline is the ILP "
            "restricted to MIG-disabled GPUs, i.e. the best whole-GPU placement, so the gain is conservative."
        ),
        ratios={
            "heuristic_gap_mean": g["gap_mean"],
            "heuristic_within_2pct_share": g["within_2pct"] / g["instances"],
            "mig_ilp_over_whole_gpu_tput": gain["mig_exact_tps"] / gain["whole_tps"],
            "mig_heuristic_over_whole_gpu_tput": gain["mig_heur_tps"] / gain["whole_tps"],
        },
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=200, help="random small instances for the gap study")
    ap.add_argument("--exact-limit", type=float, default=20.0, help="ILP time limit per stage on 1,024 GPUs (0 = skip)")
    args = ap.parse_args()
    main(args.instances, args.exact_limit)
