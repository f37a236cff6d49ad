"""The fast placer: two greedy passes and a local improvement, best result kept.

* *unit greedy* (``unit_greedy``): repeatedly place the single replica (model, slice profile or TP group) with
  the highest ``weight x min(unmet demand, capacity) / GPU fraction``, filling open MIG GPUs
  (best fit) before opening fresh ones; slices go to the start position that keeps the most
  geometries reachable. Good at packing many small demands.
* *GPU greedy*: repeatedly configure one fresh GPU (or TP group) as a whole: for every maximal
  MIG layout (and whole-GPU TP option) assign its slices greedily to unmet demand and keep
  the configuration with the most value per GPU. Avoids fragmenting a GPU that one model
  should have whole. Identical consecutive choices are applied in bulk, which keeps a
  1,024-GPU fleet well under a second.
* *local improvement* (fleets up to ``LOCAL_SEARCH_MAX_GPUS``): re-configure each used GPU
  alone given all the others, keeping strict improvements.

No solver call anywhere: time is linear in replicas placed (times layouts x models for the
GPU greedy). Every geometry it emits is a subset of a valid one, hence valid.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from placement.mig.catalog import Placement
from placement.mig.configure import Configurator, Memo
from placement.mig.problem import GpuPlan, Option, Problem, Replica, Solution, finish
from placement.mig.unit_greedy import unit_greedy

LOCAL_SEARCH_MAX_GPUS = 64
PAIR_SEARCH_MAX_GPUS = 8  # pairs of GPUs re-configured together (quadratic)
PAIR_SEARCH_FIRST = 2  # MIG configurations of a pair's first GPU tried (best by value), plus whole-GPU


@dataclass
class _Unit:
    """One configured GPU (or TP group): its geometry and the replica on each slice."""

    pool: int
    node: str
    gpus: tuple[int, ...]
    mig: bool
    assigned: list[tuple[Placement | None, Option]]
    value: float = 0.0


def _value(
    weight: dict[str, float], remaining: dict[str, float], assigned: list[tuple[Placement | None, Option]]
) -> float:
    rem = dict(remaining)
    val = 0.0
    for _, o in assigned:
        val += weight[o.model] * min(rem[o.model], o.capacity)
        rem[o.model] -= min(rem[o.model], o.capacity)
    return val


def _gpu_greedy(prob: Problem, cfg: Configurator, order: list[int] | None = None) -> list[_Unit]:
    """``order``: configure pools strictly in this order (None: the best value per GPU anywhere)."""
    remaining = {m.name: m.demand.tokens_per_s for m in prob.models.models}
    free: list[dict[str, list[int]]] = []
    fixed_left: list[list[tuple[str, int, tuple[Placement, ...]]]] = []
    for p in prob.pools:
        if p.reconfigurable:
            free.append({n: list(range(p.gpus_per_node)) for n in p.nodes})
        else:
            f: dict[str, list[int]] = defaultdict(list)
            for n, i in p.fixed_whole:
                f[n].append(i)
            free.append(f)
        fixed_left.append(list(p.fixed_slices))
    units: list[_Unit] = []
    memo = Memo(cfg, remaining)
    while True:
        best: tuple[tuple[float, float], int, str, object, list[tuple[Placement | None, Option]]] | None = None

        def consider(
            key: tuple[float, float], pi: int, kind: str, what: object, assigned: list[tuple[Placement | None, Option]]
        ) -> None:
            nonlocal best
            if assigned and (best is None or key > best[0]):
                best = (key, pi, kind, what, assigned)

        for pi in order or range(len(prob.pools)):
            if order and best is not None:
                break
            room = max((len(v) for v in free[pi].values()), default=0)
            if room:
                for li, geo in enumerate(cfg.layouts[pi]):
                    v, a = memo.fill((pi, li), pi, geo)
                    consider((v, -len(a)), pi, "mig", geo, a)
                for tp in (1, 2, 4, 8):
                    if tp <= room:
                        v, a = memo.best_whole(pi, tp)
                        consider((v / tp, -tp), pi, "whole", tp, a)
            for k, (_, _, geo) in enumerate(fixed_left[pi]):
                v, a = memo.fill(geo, pi, geo)
                consider((v, -len(a)), pi, "fixed", k, a)
        if best is None:
            break
        _, pi, kind, what, assigned = best
        need: dict[str, float] = defaultdict(float)
        for _, o in assigned:
            need[o.model] += o.capacity
        # The same configuration stays the best while it keeps its full value (others can only lose).
        repeats = 1 if kind == "fixed" else max(1, min(math.floor(remaining[m] / c) for m, c in need.items()))
        for _ in range(repeats):
            if kind == "fixed":
                node, idx, _geo = fixed_left[pi].pop(int(str(what)))
                gpus: tuple[int, ...] = (idx,)
            else:
                tp = what if kind == "whole" and isinstance(what, int) else 1
                cands = [n for n, f in free[pi].items() if len(f) >= tp]
                if not cands:
                    break
                node = min(cands, key=lambda n: len(free[pi][n]))
                gpus, free[pi][node] = tuple(free[pi][node][:tp]), free[pi][node][tp:]
            units.append(
                _Unit(pi, node, gpus, kind != "whole", list(assigned), _value(cfg.weight, remaining, assigned))
            )
            for _, o in assigned:
                memo.serve(o.model, o.capacity)
    return units


def _units_from(prob: Problem, gpus: list[GpuPlan], reps: list[Replica]) -> list[_Unit]:
    """The unit greedy's result as configured GPUs, so the local improvements apply to it."""
    pool_of = {n: pi for pi, p in enumerate(prob.pools) for n in p.nodes}
    option = {(o.model, o.pool, o.profile, o.tp): o for o in prob.choices}
    units: dict[tuple[str, tuple[int, ...]], _Unit] = {}
    for r in reps:
        pi = pool_of[r.node]
        key = (r.node, r.gpu_indices)
        u = units.setdefault(key, _Unit(pi, r.node, r.gpu_indices, r.profile is not None, []))
        pl = (r.profile, r.start) if r.profile is not None and r.start is not None else None
        u.assigned.append((pl, option[(r.model, pi, r.profile, len(r.gpu_indices))]))
    return list(units.values())


def _render(prob: Problem, units: list[_Unit]) -> tuple[list[GpuPlan], list[Replica]]:
    """Configured GPUs as plans: new MIG GPUs get only the slices they use, kept ones their whole layout."""
    fixed = {(n, i): geo for p in prob.pools for n, i, geo in p.fixed_slices}
    gpus = [
        GpuPlan(
            u.node,
            u.gpus[0],
            prob.pools[u.pool].gpu.name,
            True,
            fixed.get((u.node, u.gpus[0])) or tuple(pl for pl, _ in u.assigned if pl),
        )
        if u.mig
        else GpuPlan(u.node, i, prob.pools[u.pool].gpu.name, False, ())
        for u in units
        if u.assigned
        for i in (u.gpus if not u.mig else u.gpus[:1])
    ]
    reps = [
        Replica(o.model, u.node, u.gpus, pl[0] if pl else None, pl[1] if pl else None, o.perf)
        for u in units
        for pl, o in u.assigned
    ]
    return gpus, reps


def _improve(prob: Problem, cfg: Configurator, units: list[_Unit], remaining: dict[str, float]) -> None:
    """Re-configure single reconfigurable GPUs one at a time while that strictly adds value."""
    demand = {m.name: m.demand.tokens_per_s for m in prob.models.models}
    total: dict[str, float] = defaultdict(float)
    for u in units:
        for _, o in u.assigned:
            total[o.model] += o.capacity
    for _ in range(3):
        changed = False
        for u in units:
            if len(u.gpus) != 1 or not prob.pools[u.pool].reconfigurable:
                continue
            mine: dict[str, float] = defaultdict(float)
            for _, o in u.assigned:
                mine[o.model] += o.capacity
            rem = {m: max(0.0, d - (total[m] - mine[m])) for m, d in demand.items()}  # unmet without this GPU
            best = (_value(cfg.weight, rem, u.assigned), u.mig, u.assigned)
            for geo in cfg.layouts[u.pool]:
                v, a = cfg.fill(u.pool, geo, rem)
                if v > best[0] * (1 + 1e-9) + 1e-9:
                    best = (v, True, a)
            v, a = cfg.best_whole(u.pool, 1, rem)
            if v > best[0] * (1 + 1e-9) + 1e-9:
                best = (v, False, a)
            if best[2] is not u.assigned:
                for m, c in mine.items():
                    total[m] -= c
                u.mig, u.assigned, u.value = best[1], best[2], best[0]
                for _, o in u.assigned:
                    total[o.model] += o.capacity
                changed = True
        if not changed:
            break
    remaining.update({m: max(0.0, d - total[m]) for m, d in demand.items()})


def _configs(
    prob: Problem, cfg: Configurator, pi: int, rem: dict[str, float]
) -> list[tuple[float, bool, list[tuple[Placement | None, Option]]]]:
    out = [(v, True, a) for v, a in (cfg.fill(pi, geo, rem) for geo in cfg.layouts[pi])]
    v, a = cfg.best_whole(pi, 1, rem)
    out.append((v, False, a))
    return sorted(out, key=lambda t: -t[0])


def _improve_pairs(prob: Problem, cfg: Configurator, units: list[_Unit]) -> None:
    """Re-configure two single GPUs together (first GPU: its best few configurations, second:
    the best given the first), keeping strict improvements. Fixes greedy's cross-GPU mistakes,
    e.g. giving the big GPU to a model the small one could have served."""
    demand = {m.name: m.demand.tokens_per_s for m in prob.models.models}
    singles = [u for u in units if len(u.gpus) == 1 and prob.pools[u.pool].reconfigurable]

    def caps(us: list[_Unit]) -> dict[str, float]:
        t: dict[str, float] = defaultdict(float)
        for u in us:
            for _, o in u.assigned:
                t[o.model] += o.capacity
        return t

    def total_value(t: dict[str, float]) -> float:
        return sum(prob.specs[m].weight * min(d, t[m]) for m, d in demand.items())

    for _ in range(1):
        changed = False
        for i, u in enumerate(singles):
            for v in singles[i + 1 :]:
                others = caps([w for w in units if w is not u and w is not v])
                current = total_value(caps(units))
                rem = {m: max(0.0, d - others[m]) for m, d in demand.items()}
                best: (
                    tuple[
                        float,
                        tuple[bool, list[tuple[Placement | None, Option]]],
                        tuple[bool, list[tuple[Placement | None, Option]]],
                    ]
                    | None
                ) = None
                first = [c for c in _configs(prob, cfg, u.pool, rem) if c[1]][:PAIR_SEARCH_FIRST]
                tries = first + [  # and u whole for each model: greedy's typical miss
                    (prob.specs[o.model].weight * min(rem[o.model], o.capacity), False, [(None, o)])
                    for o in cfg.by_tp.get((u.pool, 1), ())
                ]
                for vu, mu, au in tries:
                    rem2 = dict(rem)
                    for _, o in au:
                        rem2[o.model] = max(0.0, rem2[o.model] - o.capacity)
                    vv, mv, av = _configs(prob, cfg, v.pool, rem2)[0]
                    if best is None or vu + vv > best[0]:
                        best = (vu + vv, (mu, au), (mv, av))
                base = total_value(others)
                if best is not None and base + best[0] > current * (1 + 1e-9) + 1e-9:
                    (u.mig, u.assigned), (v.mig, v.assigned) = best[1], best[2]
                    changed = True
        if not changed:
            return


def _score(prob: Problem, units: list[_Unit]) -> tuple[float, int]:
    cap: dict[str, float] = defaultdict(float)
    for u in units:
        for _, o in u.assigned:
            cap[o.model] += o.capacity
    value = sum(m.weight * min(m.demand.tokens_per_s, cap[m.name]) for m in prob.models.models)
    return value, -sum(len(u.gpus) for u in units if u.assigned)


def solve_heuristic(prob: Problem) -> Solution:
    """Four greedy passes, the best kept (value, then fewer GPUs), then local improvement."""
    t0 = time.perf_counter()
    cfg = Configurator(prob)
    speed = sorted(range(len(prob.pools)), key=lambda i: prob.pools[i].gpu.bandwidth_gbs)
    runs: list[Callable[[], list[_Unit]]] = [
        lambda: _units_from(prob, *unit_greedy(prob)),
        lambda: _gpu_greedy(prob, cfg),
        lambda: _gpu_greedy(prob, cfg, speed),  # weakest GPUs first: keeps strong ones for demanding models
        lambda: _gpu_greedy(prob, cfg, speed[::-1]),
    ]
    best: tuple[tuple[float, int], list[_Unit]] | None = None
    for run in runs:
        units = run()
        score = _score(prob, units)
        if best is None or score > (best[0][0] * (1 + 1e-12), best[0][1]):
            best = (score, units)
    assert best is not None
    units = best[1]
    if prob.fleet.gpu_count <= LOCAL_SEARCH_MAX_GPUS:
        _improve(prob, cfg, units, {})
    if prob.fleet.gpu_count <= PAIR_SEARCH_MAX_GPUS:
        _improve_pairs(prob, cfg, units)
    gpus, reps = _render(prob, units)
    return finish(prob, "heuristic", "feasible", t0, gpus, reps)
