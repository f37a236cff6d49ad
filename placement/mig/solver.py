"""Replica placement: choose MIG geometries and engine replicas for a fleet and a demand.

Problem: each GPU runs either MIG (one valid geometry, one engine process per slice) or whole
(MIG disabled; a replica may span ``tp`` whole GPUs of one node with tensor parallelism; never
across slices). Each replica serves one model at the capacity ``perf.replica_perf`` gives.
Objective, lexicographic: maximise served demand ``sum_m weight_m x min(demand_m, capacity_m)``
(tokens/s), then minimise GPUs in use.

* ``solve_exact``: an ILP over *pools* (identical reconfigurable nodes merged; fixed nodes
  alone) solved by HiGHS (``scipy.optimize.milp``) in two stages. Choosing among maximal
  layouts loses nothing (any geometry is a subset of one, spare slices stay idle), and TP
  groups are restricted to sizes that divide the node's GPU count, so the pooled GPU-count
  constraint is exact (power-of-two groups pack perfectly into such nodes).
* ``solve_heuristic``: greedy by value per GPU-fraction over explicit GPUs, placing each slice
  at the start position that keeps the most geometries reachable, filling open MIG GPUs
  before opening fresh ones. No solver call; linear in replicas placed.
* ``PlannerOptions(allow_mig=False)`` gives the whole-GPU baseline with either solver.

Every geometry produced passes ``catalog.is_valid_geometry`` (asserted in ``_finish``).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from placement.mig.catalog import GPU_TYPES, GpuType, Placement, is_valid_geometry, maximal_layouts, place_layout
from placement.mig.config import FleetFile, ModelsFile, ModelSpec, PlannerOptions
from placement.mig.memory import ModelArch
from placement.mig.perf import ReplicaPerf, replica_perf, slice_device, whole_device

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Pool:
    """Interchangeable GPUs: identical reconfigurable nodes, or one node kept as it is."""

    gpu: GpuType
    nodes: tuple[str, ...]
    gpus_per_node: int
    reconfigurable: bool
    fixed_slices: tuple[tuple[str, int, tuple[Placement, ...]], ...] = ()  # (node, gpu index, geometry)
    fixed_whole: tuple[tuple[str, int], ...] = ()  # whole GPUs of a fixed node
    profile_memory_mib: tuple[tuple[str, int], ...] = ()
    total_memory_mib: int | None = None

    @property
    def gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def memory_of(self, profile: str) -> int | None:
        return dict(self.profile_memory_mib).get(profile)


def pools_of(fleet: FleetFile) -> list[Pool]:
    groups: dict[tuple[str, int, tuple[tuple[str, int], ...], int | None], list[str]] = defaultdict(list)
    out: list[Pool] = []
    for n in fleet.nodes:
        mem = tuple(sorted(n.profile_memory_mib.items()))
        gt = GPU_TYPES[n.gpu]
        if n.reconfigurable:
            groups[(n.gpu, n.count, mem, n.total_memory_mib)].append(n.name)
            continue
        fixed = []
        for i, layout in sorted(n.mig_layouts.items()):
            geo = place_layout(gt, layout)
            assert geo is not None  # validated on load
            fixed.append((n.name, i, geo))
        whole = tuple((n.name, i) for i in range(n.count) if i not in n.mig_layouts)
        out.append(Pool(gt, (n.name,), n.count, False, tuple(fixed), whole, mem, n.total_memory_mib))
    for (gpu, count, mem, total), names in groups.items():
        out.append(Pool(GPU_TYPES[gpu], tuple(names), count, True, (), (), mem, total))
    return out


@dataclass(frozen=True)
class Option:
    """A kind of replica ``model`` can have in ``pool``: one slice of ``profile`` or ``tp`` whole GPUs."""

    model: str
    pool: int
    profile: str | None
    tp: int
    perf: ReplicaPerf

    @property
    def capacity(self) -> float:
        return self.perf.tokens_per_s

    def cost(self, gpu: GpuType) -> float:
        """Fraction of GPUs consumed (slices: the larger of memory and compute share)."""
        if self.profile is None:
            return float(self.tp)
        p = gpu.profile(self.profile)
        return max(p.size / 8, p.compute / 7)


@dataclass
class Problem:
    fleet: FleetFile
    models: ModelsFile
    archs: dict[str, ModelArch]
    options: PlannerOptions
    pools: list[Pool] = field(default_factory=list)
    choices: list[Option] = field(default_factory=list)  # every feasible option
    infeasible: dict[str, list[str]] = field(default_factory=dict)  # model -> reasons, one per device kind

    @property
    def specs(self) -> dict[str, ModelSpec]:
        return {m.name: m for m in self.models.models}


def build_problem(fleet: FleetFile, models: ModelsFile, archs: dict[str, ModelArch], opts: PlannerOptions) -> Problem:
    prob = Problem(fleet, models, archs, opts, pools_of(fleet))
    perf_cache: dict[tuple[object, ...], ReplicaPerf] = {}
    key: tuple[object, ...]
    for m in models.models:
        arch = archs[m.name]
        reasons: dict[str, str] = {}
        for pi, pool in enumerate(prob.pools):
            profiles: set[str] = set()
            if opts.allow_mig:
                if pool.reconfigurable:
                    profiles = {p.name for p in pool.gpu.placeable}
                else:
                    profiles = {name for _, _, geo in pool.fixed_slices for name, _ in geo}
            tps: list[int] = []
            if opts.allow_whole_gpu:
                room = pool.gpus_per_node if pool.reconfigurable else len(pool.fixed_whole)
                tps = [
                    t
                    for t in TP_SIZES
                    if t <= min(room, m.max_tp)
                    and arch.heads % t == 0
                    and (not pool.reconfigurable or pool.gpus_per_node % t == 0)
                ]
            for prof in sorted(profiles):
                key = (m.name, pool.gpu.name, prof, pool.memory_of(prof))
                if key not in perf_cache:
                    perf_cache[key] = replica_perf(
                        m, arch, slice_device(pool.gpu, prof, pool.memory_of(prof)), 1, opts.perf
                    )
                rp = perf_cache[key]
                if rp.tokens_per_s > 0:
                    prob.choices.append(Option(m.name, pi, prof, 1, rp))
                else:
                    reasons.setdefault(f"{pool.gpu.name} {prof}", rp.reason)
            for t in tps:
                key = (m.name, pool.gpu.name, None, t, pool.total_memory_mib)
                if key not in perf_cache:
                    perf_cache[key] = replica_perf(m, arch, whole_device(pool.gpu, pool.total_memory_mib), t, opts.perf)
                rp = perf_cache[key]
                if rp.tokens_per_s > 0:
                    prob.choices.append(Option(m.name, pi, None, t, rp))
                else:
                    reasons.setdefault(f"{pool.gpu.name} whole x{t}", rp.reason)
        if not any(o.model == m.name for o in prob.choices):
            prob.infeasible[m.name] = list(reasons.values()) or ["no GPU in the fleet can host it"]
    return prob


# ---- solutions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    model: str
    node: str
    gpu_indices: tuple[int, ...]
    profile: str | None  # None: whole GPU(s)
    start: int | None  # memory-slice start of the MIG instance
    perf: ReplicaPerf


@dataclass(frozen=True)
class GpuPlan:
    node: str
    index: int
    gpu: str
    mig: bool
    placements: tuple[Placement, ...]  # the geometry to create (mig only)


@dataclass(frozen=True)
class Unserved:
    model: str
    demand: float
    served: float
    reason: str


@dataclass
class Solution:
    solver: str
    status: str
    solve_s: float
    gpus: list[GpuPlan]
    replicas: list[Replica]
    served: dict[str, float]
    demand: dict[str, float]
    value: float  # sum of weight x served
    gpus_used: int
    gpus_total: int
    unserved: list[Unserved]

    @property
    def served_fraction(self) -> float:
        total = sum(self.demand.values())
        return sum(self.served.values()) / total if total else 1.0


def _finish(prob: Problem, name: str, status: str, t0: float, gpus: list[GpuPlan], reps: list[Replica]) -> Solution:
    for g in gpus:
        ok, why = is_valid_geometry(GPU_TYPES[g.gpu], g.placements)
        assert ok, f"placer produced an invalid geometry on {g.node}/{g.index}: {why}"
    specs = prob.specs
    cap: dict[str, float] = defaultdict(float)
    for r in reps:
        cap[r.model] += r.perf.tokens_per_s
    demand = {m: s.demand.tokens_per_s for m, s in specs.items()}
    served = {m: min(demand[m], cap[m]) for m in specs}
    used = {(r.node, i) for r in reps for i in r.gpu_indices}
    unserved = []
    for m, d in demand.items():
        if served[m] >= d * (1 - 1e-9):
            continue
        if m in prob.infeasible:
            why = "no device in the fleet can host a replica: " + "; ".join(prob.infeasible[m])
        else:
            hosts = sorted(
                {f"{prob.pools[o.pool].gpu.name} {o.profile or f'whole x{o.tp}'}" for o in prob.choices if o.model == m}
            )
            free = prob.fleet.gpu_count - len(used)
            why = (
                f"capacity: the devices that can host it ({', '.join(hosts)}) are taken by replicas worth more "
                f"(objective: weight x tokens/s; raise its weight to favour it); "
                + (f"{free} GPU(s) left free cannot host it" if free else "no GPU is left free")
            )
        unserved.append(Unserved(m, d, served[m], why))
    value = sum(specs[m].weight * served[m] for m in specs)
    gpus = sorted(gpus, key=lambda g: (g.node, g.index))
    reps = sorted(reps, key=lambda r: (r.model, r.node, r.gpu_indices, r.start or 0))
    return Solution(
        name,
        status,
        time.perf_counter() - t0,
        gpus,
        reps,
        served,
        demand,
        value,
        len(used),
        prob.fleet.gpu_count,
        unserved,
    )


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
    return _finish(prob, "exact", status, t0, gpus, reps)


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
    if prob.options.solver == "exact":
        return solve_exact(prob)
    from placement.mig.heuristic import solve_heuristic

    return solve_heuristic(prob)
