"""The placement problem and its solutions, shared by every placer (``solver``, ``heuristic``, ``unit_greedy``,
``configure``) and by ``plan``.

Problem: each GPU runs either MIG (one valid geometry, one engine process per slice) or whole
(MIG disabled; a replica may span ``tp`` whole GPUs of one node with tensor parallelism; never
across slices). Each replica serves one model at the capacity ``perf.replica_perf`` gives.
``build_problem`` merges identical reconfigurable nodes into *pools* (fixed nodes stay alone) and lists
every feasible ``Option`` (a model on a slice profile or a TP group of a pool).

A placer returns its GPUs and replicas through ``finish``, which asserts that every geometry passes
``catalog.is_valid_geometry`` and builds the ``Solution`` (served demand, GPUs used, why demand is unmet).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from placement.mig.catalog import GPU_TYPES, GpuType, Placement, is_valid_geometry, place_layout
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


def finish(prob: Problem, name: str, status: str, t0: float, gpus: list[GpuPlan], reps: list[Replica]) -> Solution:
    """A placer's result (``name``, started at ``t0``) as a ``Solution``: every geometry checked valid, what each
    model is served, and why any demand is left unmet."""
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
