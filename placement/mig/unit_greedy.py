"""The heuristic placer's unit greedy: place one replica at a time where it adds the most value.

Repeatedly place the single replica (model, slice profile or TP group) with the highest
``weight x min(unmet demand, capacity) / GPU fraction``, filling open MIG GPUs (best fit)
before opening fresh ones; slices go to the start position that keeps the most geometries
reachable. Good at packing many small demands (``heuristic.solve_heuristic`` compares it with
the GPU greedy and keeps the better plan).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field

from placement.mig.catalog import GPU_TYPES, Placement
from placement.mig.problem import GpuPlan, Option, Pool, Problem, Replica

State = tuple[int, int]  # (occupied memory-slice mask, compute slices used)


@functools.cache
def _reachable(gpu_name: str, state: State) -> int:
    """Number of distinct states (geometries up to profile names) reachable from ``state``: its room."""
    gpu = GPU_TYPES[gpu_name]
    seen = {state}
    stack = [state]
    while stack:
        mask, compute = stack.pop()
        for p in gpu.placeable:
            for m in p.mask_at.values():
                nxt = (mask | m, compute + p.compute)
                if not mask & m and nxt[1] <= 7 and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    return len(seen)


@functools.cache
def _best_start(gpu_name: str, state: State, profile: str) -> tuple[int, State] | None:
    """Where to put ``profile`` on a GPU in ``state``: the start that keeps the most room."""
    p = GPU_TYPES[gpu_name].profile(profile)
    best: tuple[int, State] | None = None
    for s, mask in p.mask_at.items():
        if state[0] & mask or state[1] + p.compute > 7:
            continue
        nxt = (state[0] | mask, state[1] + p.compute)
        if best is None or _reachable(gpu_name, nxt) > _reachable(gpu_name, best[1]):
            best = (s, nxt)
    return best


@dataclass
class _Gpu:
    node: str
    index: int
    state: State = (0, 0)
    placements: list[Placement] = field(default_factory=list)


class _PoolState:
    """Free capacity of one pool during the greedy: fresh GPUs per node, open MIG GPUs by state."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.fresh: dict[str, list[int]] = {}
        if pool.reconfigurable:
            self.fresh = {n: list(range(pool.gpus_per_node)) for n in pool.nodes}
        else:
            for node, idx in pool.fixed_whole:
                self.fresh.setdefault(node, []).append(idx)
        self.open: dict[State, list[_Gpu]] = defaultdict(list)  # MIG GPUs with room, by state
        self.fixed_slices: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        self.fixed_gpus = [GpuPlan(n, i, pool.gpu.name, True, geo) for n, i, geo in pool.fixed_slices]
        for node, idx, geo in pool.fixed_slices:
            for prof, start in geo:
                self.fixed_slices[prof].append((node, idx, start))
        self.all_mig: list[_Gpu] = []
        self.whole: list[GpuPlan] = []

    def can(self, o: Option) -> bool:
        if o.profile is None:
            return any(len(f) >= o.tp for f in self.fresh.values())
        if not self.pool.reconfigurable:
            return bool(self.fixed_slices[o.profile])
        name = self.pool.gpu.name
        if any(g and _best_start(name, st, o.profile) for st, g in self.open.items()):
            return True
        return any(self.fresh.values())

    def take(self, o: Option) -> Replica:
        if o.profile is None:  # tightest node that has room: keeps big nodes for big groups
            node = min((n for n, f in self.fresh.items() if len(f) >= o.tp), key=lambda n: len(self.fresh[n]))
            taken, self.fresh[node] = self.fresh[node][: o.tp], self.fresh[node][o.tp :]
            self.whole += [GpuPlan(node, i, self.pool.gpu.name, False, ()) for i in taken]
            return Replica(o.model, node, tuple(taken), None, None, o.perf)
        if not self.pool.reconfigurable:
            node, idx, start = self.fixed_slices[o.profile].pop(0)
            return Replica(o.model, node, (idx,), o.profile, start, o.perf)
        name = self.pool.gpu.name
        fits = [(st, _best_start(name, st, o.profile)) for st, g in self.open.items() if g]
        fits = [(st, b) for st, b in fits if b]
        if fits:  # best fit: the fullest open GPU that takes it
            st, _ = max(fits, key=lambda t: (bin(t[0][0]).count("1"), _reachable(name, t[1][1])))  # type: ignore[index]
            gpu = self.open[st].pop()
        else:
            node = min((n for n, f in self.fresh.items() if f), key=lambda n: len(self.fresh[n]))
            gpu = _Gpu(node, self.fresh[node].pop(0))
            self.all_mig.append(gpu)
        start, nxt = _best_start(name, gpu.state, o.profile)  # type: ignore[misc]
        gpu.state = nxt
        gpu.placements.append((o.profile, start))
        if _reachable(name, nxt) > 1:
            self.open[nxt].append(gpu)
        return Replica(o.model, gpu.node, (gpu.index,), o.profile, start, o.perf)

    def plans(self) -> list[GpuPlan]:
        mig = [GpuPlan(g.node, g.index, self.pool.gpu.name, True, tuple(g.placements)) for g in self.all_mig]
        return mig + self.whole + self.fixed_gpus


def unit_greedy(prob: Problem) -> tuple[list[GpuPlan], list[Replica]]:
    specs = prob.specs
    states = [_PoolState(p) for p in prob.pools]
    remaining = {m: s.demand.tokens_per_s for m, s in specs.items()}
    by_model: dict[str, list[tuple[Option, float, float, _PoolState]]] = defaultdict(list)
    for o in prob.choices:  # with its cost and capacity, computed once
        by_model[o.model].append((o, o.cost(prob.pools[o.pool].gpu), o.capacity, states[o.pool]))
    reps: list[Replica] = []
    while True:
        best: tuple[float, float, Option] | None = None
        for m, left in remaining.items():
            if left <= 1e-9:
                continue
            w = specs[m].weight
            for o, cost, cap, state in by_model[m]:
                score = w * (left if left < cap else cap) / cost
                if (best is None or (score, -cost) > (best[0], -best[1])) and state.can(o):
                    best = (score, cost, o)
        if best is None:
            break
        o = best[2]
        # Placing more of the same keeps it the best choice while a whole replica's capacity is still
        # needed (other scores do not change), so place those in one go.
        n = max(1, math.floor(remaining[o.model] / o.capacity))
        for _ in range(n):
            if not states[o.pool].can(o):
                break
            reps.append(states[o.pool].take(o))
            remaining[o.model] -= o.capacity
    return [g for st in states for g in st.plans()], reps
