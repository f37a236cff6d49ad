"""The heuristic's single-GPU configurator: the fast fill equals a plain scan, and the memo of one greedy
pass returns exactly what scoring again would (issue 24: the 1,024-GPU plan is fast *and* unchanged)."""

from __future__ import annotations

import random

import pytest

from bench import placement_scenarios as scenarios
from placement.mig.catalog import Placement
from placement.mig.config import PlannerOptions
from placement.mig.configure import Assigned, Configurator, Memo
from placement.mig.problem import Option, Problem, build_problem


def plain_fill(cfg: Configurator, pi: int, geo: tuple[Placement, ...], remaining: dict[str, float]) -> Assigned:
    """The reference: every step scans every (slice profile, model) pair, the first best one wins."""
    groups = cfg._groups(pi, geo)
    best: Assigned = (0.0, [])
    for dense in (True, False):
        rem: dict[str, float] = {}
        left = [len(pls) for _, pls, _ in groups]
        val = 0.0
        out: list[tuple[Placement | None, Option]] = []
        while True:
            pick_key = (-1.0, 0.0)
            pick: tuple[int, str, float, Option] | None = None
            for gi, (cost, _, opts) in enumerate(groups):
                for model, cap, w, o in opts if left[gi] else ():
                    r = rem.get(model, remaining[model])
                    g = w * min(r, cap)
                    k = (g / cost if dense else g, -cost)
                    if g > 1e-9 and k > pick_key:
                        pick_key, pick = k, (gi, model, g, o)
            if pick is None:
                break
            gi, model, g, o = pick
            pls = groups[gi][1]
            out.append((pls[len(pls) - left[gi]], o))
            left[gi] -= 1
            val += g
            r = rem.get(model, remaining[model])
            rem[model] = r - min(r, o.capacity)
        if val > best[0]:
            best = (val, out)
    return best


def problems() -> list[Problem]:
    rng = random.Random(7)
    out = [build_problem(*scenarios.random_small(rng), PlannerOptions()) for _ in range(6)]
    out.append(build_problem(*scenarios.large_fleet(gpus=48, models=12, seed=3), PlannerOptions()))
    out.append(build_problem(*scenarios.mixed_small_models(gpus=8, models=10), PlannerOptions()))
    return out


@pytest.mark.parametrize("prob", problems(), ids=lambda p: f"{p.fleet.gpu_count}gpus-{len(p.models.models)}models")
def test_fill_and_memo_equal_a_plain_rescore_while_demand_falls(prob: Problem) -> None:
    rng = random.Random(prob.fleet.gpu_count)
    cfg = Configurator(prob)
    remaining = {m.name: m.demand.tokens_per_s for m in prob.models.models}
    memo = Memo(cfg, remaining)
    checked = 0
    for _ in range(12):
        for pi in range(len(prob.pools)):
            for li, geo in enumerate(cfg.layouts[pi]):
                want = plain_fill(cfg, pi, geo, dict(remaining))
                assert cfg.fill(pi, geo, dict(remaining)) == want
                assert memo.fill((pi, li), pi, geo) == want
                checked += 1
            for tp in (1, 2, 4, 8):
                assert memo.best_whole(pi, tp) == cfg.best_whole(pi, tp, dict(remaining))
        # Serve what the greedy would: the models of one of the current best configurations, in random amounts.
        served = [
            o
            for pi in range(len(prob.pools))
            for geo in cfg.layouts[pi][:3]
            for _, o in cfg.fill(pi, geo, remaining)[1]
        ]
        for o in rng.sample(served, min(len(served), 2)):
            memo.serve(o.model, o.capacity * rng.choice([0.5, 1.0, 3.0]))
    assert checked > 0 or not any(cfg.layouts.values())
