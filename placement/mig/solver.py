"""Replica placement: choose MIG geometries and engine replicas for a fleet and a demand.

The problem (pools, options) and its solutions are ``problem``'s. Objective, lexicographic: maximise served
demand ``sum_m weight_m x min(demand_m, capacity_m)`` (tokens/s), then minimise GPUs in use.

* ``solve_exact``: an ILP over *pools* (identical reconfigurable nodes merged; fixed nodes
  alone) solved by HiGHS (``scipy.optimize.milp``) in two stages. Choosing among maximal
  layouts loses nothing (any geometry is a subset of one, spare slices stay idle), and TP
  groups are restricted to sizes that divide the node's GPU count, so the pooled GPU-count
  constraint is exact (power-of-two groups pack perfectly into such nodes).
* ``solve_heuristic`` (``heuristic``): greedy by value per GPU-fraction over explicit GPUs, placing each slice
  at the start position that keeps the most geometries reachable, filling open MIG GPUs
  before opening fresh ones. No solver call; linear in replicas placed.
* ``PlannerOptions(allow_mig=False)`` gives the whole-GPU baseline with either solver.

Every geometry produced passes ``catalog.is_valid_geometry`` (asserted in ``problem.finish``).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from placement.mig.catalog import Placement, maximal_layouts
from placement.mig.heuristic import solve_heuristic
from placement.mig.problem import GpuPlan, Problem, Replica, Solution, finish

# ---- exact ----------------------------------------------------------------------------------


@dataclass
class _Milp:
    """The exact problem's variables (served rate per model, layout counts ``y``, option counts ``o``) and
    constraint rows ``(coefficients, lower, upper)``."""

    n: int
    s_idx: dict[str, int]
    y_idx: dict[tuple[int, int], int]
    o_idx: list[int]
    layouts: dict[int, tuple[tuple[tuple[str, ...], tuple[Placement, ...]], ...]]
    rows: list[tuple[dict[int, float], float, float]]

    def matrix(self, extra: list[tuple[dict[int, float], float, float]]) -> LinearConstraint:
        all_rows = self.rows + extra
        a = lil_matrix((len(all_rows), self.n))
        for r, (coef, _, _) in enumerate(all_rows):
            for j, v in coef.items():
                a[r, j] = v
        return LinearConstraint(a.tocsr(), [lo for _, lo, _ in all_rows], [hi for _, _, hi in all_rows])


def _milp(prob: Problem) -> _Milp:
    """Variables and rows: per pool, whole GPUs and each MIG profile's slices within what its layouts give;
    per model, the served rate within what its replicas can serve."""
    var_names: list[tuple[object, ...]] = []

    def var(*key: object) -> int:
        var_names.append(key)
        return len(var_names) - 1

    s_idx = {m: var("s", m) for m in prob.specs}
    y_idx: dict[tuple[int, int], int] = {}
    layouts: dict[int, tuple[tuple[tuple[str, ...], tuple[Placement, ...]], ...]] = {}
    for pi, pool in enumerate(prob.pools):
        if pool.reconfigurable and prob.options.allow_mig:
            layouts[pi] = maximal_layouts(pool.gpu.name)
            for k in range(len(layouts[pi])):
                y_idx[(pi, k)] = var("y", pi, k)
    o_idx = [var("o", i) for i in range(len(prob.choices))]
    rows: list[tuple[dict[int, float], float, float]] = []  # (coefficients, lower, upper)
    for pi, pool in enumerate(prob.pools):
        gpu_row: dict[int, float] = {}
        for k in range(len(layouts.get(pi, ()))):
            gpu_row[y_idx[(pi, k)]] = 1
        slice_rows: dict[str, dict[int, float]] = defaultdict(dict)
        for i, o in enumerate(prob.choices):
            if o.pool != pi:
                continue
            if o.profile is None:
                gpu_row[o_idx[i]] = o.tp
            else:
                slice_rows[o.profile][o_idx[i]] = 1
        whole_cap = pool.gpus if pool.reconfigurable else len(pool.fixed_whole)
        rows.append((gpu_row, -np.inf, whole_cap))
        fixed = Counter(name for _, _, geo in pool.fixed_slices for name, _ in geo)
        for prof, row in slice_rows.items():
            for k, (layout, _) in enumerate(layouts.get(pi, ())):
                c = layout.count(prof)
                if c:
                    row[y_idx[(pi, k)]] = -c
            rows.append((row, -np.inf, fixed[prof]))
    for m in prob.specs:
        row = {s_idx[m]: 1.0}
        for i, o in enumerate(prob.choices):
            if o.model == m:
                row[o_idx[i]] = -o.capacity
        rows.append((row, -np.inf, 0.0))
    return _Milp(len(var_names), s_idx, y_idx, o_idx, layouts, rows)


def solve_exact(prob: Problem) -> Solution:
    t0 = time.perf_counter()
    specs = prob.specs
    mp = _milp(prob)
    n, s_idx, y_idx, o_idx = mp.n, mp.s_idx, mp.y_idx, mp.o_idx
    lower = np.zeros(n)
    upper = np.full(n, np.inf)
    integrality = np.ones(n)
    value = np.zeros(n)
    for m, j in s_idx.items():
        upper[j] = specs[m].demand.tokens_per_s
        integrality[j] = 0
        value[j] = specs[m].weight
    opts = {"time_limit": prob.options.time_limit_s, "mip_rel_gap": 1e-7}
    r1 = milp(-value, constraints=mp.matrix([]), integrality=integrality, bounds=Bounds(lower, upper), options=opts)
    if r1.x is None:
        raise RuntimeError(f"HiGHS found no solution: {r1.message}")
    best = float(value @ r1.x)
    # Stage 2: keep (almost all of) the served value, use as few GPUs and replicas as possible.
    gpus_cost = np.zeros(n)
    for j in y_idx.values():
        gpus_cost[j] = 1
    eps = 1.0 / (sum(p.gpus for p in prob.pools) * 8 + 1)
    for i, o in enumerate(prob.choices):
        gpus_cost[o_idx[i]] = (o.tp if o.profile is None else 0) + eps
    keep = ({j: float(value[j]) for j in s_idx.values()}, best - 1e-6 * max(1.0, best), np.inf)
    r2 = milp(
        gpus_cost, constraints=mp.matrix([keep]), integrality=integrality, bounds=Bounds(lower, upper), options=opts
    )
    x = r2.x if r2.x is not None else r1.x
    status = "optimal" if r1.status == 0 and r2.status == 0 else f"stopped: {r1.message} / {r2.message}"
    counts = np.rint(x).astype(int)
    gpus, reps = _realise(
        prob, {key: int(counts[j]) for key, j in y_idx.items()}, [int(counts[j]) for j in o_idx], mp.layouts
    )
    return finish(prob, "exact", status, t0, gpus, reps)


def _realise(
    prob: Problem,
    y: dict[tuple[int, int], int],
    o_count: list[int],
    layouts: dict[int, tuple[tuple[tuple[str, ...], tuple[Placement, ...]], ...]],
) -> tuple[list[GpuPlan], list[Replica]]:
    """Turn pooled counts into concrete GPUs, geometries and replicas."""
    gpus: list[GpuPlan] = []
    reps: list[Replica] = []
    for pi, pool in enumerate(prob.pools):
        mine = [(prob.choices[i], c) for i, c in enumerate(o_count) if c and prob.choices[i].pool == pi]
        if pool.reconfigurable:
            free = {node: list(range(pool.gpus_per_node)) for node in pool.nodes}
        else:
            free = defaultdict(list)
            for node, idx in pool.fixed_whole:
                free[node].append(idx)
        # Whole-GPU groups first, largest first, each within one node.
        groups = sorted(((o, o.tp) for o, c in mine if o.profile is None for _ in range(c)), key=lambda t: -t[1])
        for o, tp in groups:
            node = next(nd for nd, f in free.items() if len(f) >= tp)
            taken, free[node] = free[node][:tp], free[node][tp:]
            gpus += [GpuPlan(node, i, pool.gpu.name, False, ()) for i in taken]
            reps.append(Replica(o.model, node, tuple(taken), None, None, o.perf))
        slots: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        for k, cnt in ((k, c) for (p, k), c in y.items() if p == pi and c):
            geo = layouts[pi][k][1]
            for _ in range(cnt):
                node = next(nd for nd, f in free.items() if f)
                idx = free[node].pop(0)
                gpus.append(GpuPlan(node, idx, pool.gpu.name, True, geo))
                for prof, start in geo:
                    slots[prof].append((node, idx, start))
        for node, idx, geo in pool.fixed_slices:
            gpus.append(GpuPlan(node, idx, pool.gpu.name, True, geo))
            for prof, start in geo:
                slots[prof].append((node, idx, start))
        for o, c in mine:
            if o.profile is None:
                continue
            for _ in range(c):
                node, idx, start = slots[o.profile].pop(0)
                reps.append(Replica(o.model, node, (idx,), o.profile, start, o.perf))
    used = {(r.node, i) for r in reps for i in r.gpu_indices}
    return [g for g in gpus if (g.node, g.index) in used], reps


def solve(prob: Problem) -> Solution:
    """The placement ``prob.options.solver`` names (``exact`` or ``heuristic``)."""
    if prob.options.solver == "exact":
        return solve_exact(prob)
    return solve_heuristic(prob)
