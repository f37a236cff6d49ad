"""Best configurations of one GPU against unmet demand, for the heuristic placer (``heuristic``).

``Configurator.fill`` assigns a MIG geometry's slices to unmet demand greedily; ``best_whole``
picks the best whole-GPU (TP group) replica. ``Memo`` keeps their results across one GPU greedy
pass, in which unmet demand only falls, and re-scores only what a step can have changed: the
results are exactly those of scoring everything again (``tests/unit/test_placement_solver.py``
compares both on random instances).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from placement.mig.catalog import Placement, maximal_layouts
from placement.mig.problem import Option, Problem

Assigned = tuple[float, list[tuple[Placement | None, Option]]]
Opts = list[tuple[str, float, float, Option]]  # (model, capacity, weight, option) of one slice profile
# A candidate: (-key, index in its Opts, model, value, option, weight, capacity); a list of them
# sorted ascending is best first, the first option winning ties (as a scan in Opts order would).
Cand = tuple[float, int, str, float, Option, float, float]
Ranker = Callable[[int, str, float, Opts], list[Cand]]
Group = tuple[float, list[Placement], Opts]  # one profile's slices of a geometry: (cost, placements, opts)


def ranked(opts: Opts, div: float, remaining: dict[str, float], only: Iterable[int] | None = None) -> list[Cand]:
    """Options with value ``weight x min(unmet, capacity)`` > 0, by value / ``div`` (``only``: these indices)."""
    out = []
    for i in range(len(opts)) if only is None else only:
        model, cap, w, o = opts[i]
        r = remaining[model]
        g = w * (r if r < cap else cap)
        if g > 1e-9:
            out.append((-(g / div), i, model, g, o, w, cap))
    out.sort()
    return out


def best_of(cands: list[Cand], div: float, rem: dict[str, float]) -> Cand | None:
    """The best candidate once the models in ``rem`` have less unmet demand than ``cands`` were ranked with.

    The first candidate whose model is not in ``rem`` kept its score and beats everything after it;
    only the changed models ranked before it can still win (with their new, lower score)."""
    best: Cand | None = None
    for c in cands:
        r = rem.get(c[2])
        if r is None:
            return c if best is None or c < best else best
        g = c[5] * (r if r < c[6] else c[6])
        if g > 1e-9:
            n = (-(g / div), c[1], c[2], g, c[4], c[5], c[6])
            if best is None or n < best:
                best = n
    return best


class Configurator:
    """Best single-GPU configurations of each pool against the current unmet demand."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.weight = {m.name: m.weight for m in prob.models.models}
        self.by_profile: dict[tuple[int, str], list[Option]] = defaultdict(list)
        self.by_tp: dict[tuple[int, int], list[Option]] = defaultdict(list)
        for o in prob.choices:
            if o.profile is None:
                self.by_tp[(o.pool, o.tp)].append(o)
            else:
                self.by_profile[(o.pool, o.profile)].append(o)
        self.layouts = {
            pi: [geo for _, geo in maximal_layouts(p.gpu.name)] if p.reconfigurable and prob.options.allow_mig else []
            for pi, p in enumerate(prob.pools)
        }
        self._group_cache: dict[tuple[int, tuple[Placement, ...]], list[Group]] = {}

    def _groups(self, pi: int, geo: tuple[Placement, ...]) -> list[Group]:
        """A geometry's slices grouped by profile: (cost, placements, [(model, capacity, weight, option)])."""
        key = (pi, geo)
        if key not in self._group_cache:
            gpu = self.prob.pools[pi].gpu
            by: dict[str, list[Placement]] = defaultdict(list)
            for pl in geo:
                by[pl[0]].append(pl)
            self._group_cache[key] = [
                (
                    max(gpu.profile(prof).size / 8, gpu.profile(prof).compute / 7),
                    sorted(pls, key=lambda t: t[1]),
                    [(o.model, o.capacity, self.weight[o.model], o) for o in self.by_profile.get((pi, prof), ())],
                )
                for prof, pls in by.items()
            ]
        return self._group_cache[key]

    def fill(self, pi: int, geo: tuple[Placement, ...], remaining: dict[str, float]) -> Assigned:
        """Assign a geometry's slices to unmet demand: greedy over (slice, model) pairs, ranked by
        value per GPU fraction and by plain value; the better of the two assignments wins."""
        return self.fill_used(pi, geo, remaining)[0]

    def fill_used(
        self, pi: int, geo: tuple[Placement, ...], remaining: dict[str, float], rank: Ranker | None = None
    ) -> tuple[Assigned, dict[str, float]]:
        """``fill`` and the models either ranking picked (the only ones whose unmet demand it read as
        a winner: see ``Memo``), each with the most capacity one ranking gave it.
        ``rank(pi, profile, div, opts)``: ``ranked`` against ``remaining``."""
        groups = self._groups(pi, geo)
        best: Assigned = (0.0, [])
        used: dict[str, float] = {}
        for dense in (True, False):
            divs = [cost if dense else 1.0 for cost, _, _ in groups]
            if rank is None:
                lists = [ranked(opts, d, remaining) for (_, _, opts), d in zip(groups, divs, strict=True)]
            else:
                lists = [rank(pi, pls[0][0], d, opts) for (_, pls, opts), d in zip(groups, divs, strict=True)]
            val, out = _greedy(groups, divs, lists, remaining)
            took: dict[str, float] = defaultdict(float)
            for _, o in out:
                took[o.model] += o.capacity
            for m, c in took.items():
                used[m] = max(used.get(m, 0.0), c)
            if val > best[0]:
                best = (val, out)
        return best, used

    def best_whole(self, pi: int, tp: int, remaining: dict[str, float]) -> Assigned:
        best: tuple[float, Option] | None = None
        for o in self.by_tp.get((pi, tp), ()):
            g = self.weight[o.model] * min(remaining[o.model], o.capacity)
            if g > 1e-9 and (best is None or g > best[0]):
                best = (g, o)
        return (best[0], [(None, best[1])]) if best else (0.0, [])


def _greedy(
    groups: list[Group], divs: list[float], lists: list[list[Cand]], remaining: dict[str, float]
) -> tuple[float, list[tuple[Placement | None, Option]]]:
    """Fill the slices one at a time with the best (slice, model) pair: the value, the assignment and
    the unmet demand left of the models picked. A pick changes one model's unmet demand, so only the
    groups whose best candidate was that model (and lost value) look for a new one."""
    rem: dict[str, float] = {}
    left = [len(pls) for _, pls, _ in groups]
    costs = [cost for cost, _, _ in groups]
    tops = [c[0] if c else None for c in lists]
    val = 0.0
    out: list[tuple[Placement | None, Option]] = []
    while True:
        bk, bc, gi = -1.0, 0.0, -1  # the best (key, then lower cost), the first group winning ties
        for i, top in enumerate(tops):
            if top is not None and left[i]:
                k, c = -top[0], costs[i]
                if k > bk or (k == bk and c < bc):
                    bk, bc, gi = k, c, i
        if gi < 0:
            return val, out
        top = tops[gi]
        assert top is not None
        model, g, o, cap = top[2], top[3], top[4], top[6]
        pls = groups[gi][1]
        out.append((pls[len(pls) - left[gi]], o))
        left[gi] -= 1
        val += g
        r = rem.get(model)
        if r is None:
            r = remaining[model]
        r = rem[model] = r - (r if r < cap else cap)
        for i, t in enumerate(tops):
            if t is not None and t[2] == model and r < t[6]:  # its value fell
                tops[i] = best_of(lists[i], divs[i], rem)


class Memo:
    """``fill``/``best_whole`` results during one GPU greedy pass, where unmet demand only falls.

    A result stays exact while every model it picked keeps its unmet demand, or at least as much as
    the capacity it was given (then each of its picks still scores ``weight x capacity``): every
    other model's candidates can only score lower than before, and they lost (or tied later in the
    scan) already, so each greedy step picks the same again. The pass re-scores only configurations
    that involve a model the last step served, and re-ranks only the candidates of served models."""

    def __init__(self, cfg: Configurator, remaining: dict[str, float]) -> None:
        self.cfg = cfg
        self.remaining = remaining
        self.seen: dict[object, tuple[Assigned, list[tuple[str, float, float]]]] = {}
        self.changed: list[str] = []  # models served so far, in order
        self.lists: dict[tuple[int, str, float], tuple[list[Cand], int]] = {}
        self.where: dict[tuple[int, str], dict[str, int]] = {}  # (pool, profile) -> model -> index in its Opts

    def serve(self, model: str, capacity: float) -> None:
        self.remaining[model] = max(0.0, self.remaining[model] - capacity)
        self.changed.append(model)

    def rank(self, pi: int, profile: str, div: float, opts: Opts) -> list[Cand]:
        key = (pi, profile, div)
        got = self.lists.get(key)
        n = len(self.changed)
        if got is None:
            cands = ranked(opts, div, self.remaining)
        elif got[1] == n:
            return got[0]
        else:
            changed = set(self.changed[got[1] :])
            where = self.where.get(key[:2])
            if where is None:
                where = self.where[key[:2]] = {m: i for i, (m, _, _, _) in enumerate(opts)}
            idx = sorted(where[m] for m in changed if m in where)
            cands = [c for c in got[0] if c[2] not in changed] + ranked(opts, div, self.remaining, idx)
            cands.sort()
        self.lists[key] = (cands, n)
        return cands

    def _hit(self, key: object) -> Assigned | None:
        got = self.seen.get(key)
        if got is None:
            return None
        rem = self.remaining
        for m, r, need in got[1]:
            now = rem[m]
            if now != r and now < need:
                return None
        return got[0]

    def _keep(self, key: object, res: Assigned, used: dict[str, float]) -> Assigned:
        self.seen[key] = (res, [(m, self.remaining[m], need) for m, need in used.items()])
        return res

    def fill(self, key: object, pi: int, geo: tuple[Placement, ...]) -> Assigned:
        hit = self._hit(key)
        return hit if hit is not None else self._keep(key, *self.cfg.fill_used(pi, geo, self.remaining, self.rank))

    def best_whole(self, pi: int, tp: int) -> Assigned:
        key = ("whole", pi, tp)
        hit = self._hit(key)
        if hit is not None:
            return hit
        res = self.cfg.best_whole(pi, tp, self.remaining)
        return self._keep(key, res, {o.model: o.capacity for _, o in res[1]})
