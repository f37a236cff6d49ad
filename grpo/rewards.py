"""``RewardComputer``: a batch of trajectories -> one reward each, by one of three methods.

* ``"absolute"``: the reward function's value (by default the reward the environment graded, ``t.reward``);
* ``"relative"``: GRPO-style ranking inside each group: the average rank of the absolute reward among the
  group's members (ties share their mean rank) scaled to [0, 1]; a group of one gets 0.5;
* ``"pareto"``: multi-objective (``ParetoRewardComputer``): non-dominated sorting of the objective vectors
  inside each group (front 0 = dominated by nobody; every objective is maximised), crowding distance as the
  tie-break inside a front; a better front always scores higher than a worse one.

A group is the trajectories sharing a ``group``; those that carry none (no attribute, or ``None``) form one
group together: the batch, when no trajectory carries one.

The reward functions are the project's one grader system: any ``envhub.Grader`` (an ``envhub.Rubric`` of
``grpo.rater`` functions, for instance) is a callable from a trajectory to a float and fits here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from scipy.stats import rankdata

Method = Literal["absolute", "relative", "pareto"]
FloatArray = npt.NDArray[np.float64]


class Graded(Protocol):
    """What the reward computer reads from a trajectory (``grpo.rollout.Trajectory`` has it)."""

    reward: float
    group: int


def dominance(points: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """``D[i, j]``: point ``i`` dominates ``j`` (>= on every objective, > on one; objectives maximised)."""
    p = np.asarray(points, dtype=np.float64)
    ge = (p[:, None, :] >= p[None, :, :]).all(-1)
    gt = (p[:, None, :] > p[None, :, :]).any(-1)
    return np.asarray(ge & gt, dtype=bool)


def pareto_ranks(points: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Front index per point by fast non-dominated sorting (Deb et al. 2002): 0 = not dominated."""
    p = np.asarray(points, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"points must be [n, objectives], got shape {p.shape}")
    n = p.shape[0]
    dom = dominance(p)
    counts = dom.sum(axis=0)  # how many points dominate each one
    ranks = np.full(n, -1, dtype=np.int64)
    front = np.flatnonzero(counts == 0)
    level = 0
    while front.size:
        ranks[front] = level
        counts = counts - dom[front].sum(axis=0)
        counts[ranks >= 0] = -1  # assigned: never again
        front = np.flatnonzero(counts == 0)
        level += 1
    return ranks


def crowding_distance(points: npt.ArrayLike, ranks: npt.ArrayLike) -> FloatArray:
    """NSGA-II crowding distance of each point within its front (inf at a front's extremes)."""
    p = np.asarray(points, dtype=np.float64)
    r = np.asarray(ranks)
    out = np.zeros(p.shape[0])
    for level in np.unique(r):
        idx = np.flatnonzero(r == level)
        if idx.size <= 2:
            out[idx] = np.inf
            continue
        for m in range(p.shape[1]):
            order = idx[np.argsort(p[idx, m], kind="stable")]
            span = p[order[-1], m] - p[order[0], m]
            out[order[0]] = out[order[-1]] = np.inf
            if span > 0:
                out[order[1:-1]] += (p[order[2:], m] - p[order[:-2], m]) / span
    return out


def pareto_scores(points: npt.ArrayLike) -> FloatArray:
    """Rewards in [0, 1]: ``(worst - front + crowding/2) / (worst + 1/2)``, crowding scaled to [0, 1] per front."""
    p = np.asarray(points, dtype=np.float64)
    if p.shape[0] == 0:
        return np.zeros(0)
    ranks = pareto_ranks(p)
    cd = crowding_distance(p, ranks)
    scaled = np.zeros_like(cd)
    for level in np.unique(ranks):
        idx = np.flatnonzero(ranks == level)
        finite = cd[idx][np.isfinite(cd[idx])]
        top = float(finite.max()) if finite.size else 0.0
        scaled[idx] = np.where(np.isfinite(cd[idx]), cd[idx] / top if top > 0 else 0.0, 1.0)
    worst = float(ranks.max())
    return (worst - ranks + 0.5 * scaled) / (worst + 0.5)


def relative_ranks(rewards: npt.ArrayLike) -> FloatArray:
    """Average ranks of ``rewards`` scaled to [0, 1] (0 = lowest); 0.5 for a single member."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size <= 1:
        return np.full(r.size, 0.5)
    return (rankdata(r, method="average") - 1.0) / (r.size - 1)


def _by_group(trajectories: Sequence[Any]) -> dict[int | None, list[int]]:
    """Indices per ``group``; the members without one (no ``group`` or ``None``) form one group: the batch."""
    groups: dict[int | None, list[int]] = {}
    for i, t in enumerate(trajectories):
        group = getattr(t, "group", None)
        groups.setdefault(None if group is None else int(group), []).append(i)
    return groups


class RewardComputer:
    """Rewards of a batch by ``method`` (module docstring); ``reward_fn`` defaults to ``t.reward``."""

    def __init__(
        self,
        reward_fn: Callable[[Any], float] | None = None,
        objective_functions: Sequence[Callable[[Any], float]] = (),
        objective_names: Sequence[str] = (),
    ) -> None:
        if objective_names and len(objective_names) != len(objective_functions):
            raise ValueError(f"{len(objective_functions)} objective functions but {len(objective_names)} names")
        self.reward_fn = reward_fn or (lambda t: float(t.reward))
        self.objective_functions = tuple(objective_functions)
        self.objective_names = tuple(objective_names) or tuple(
            f"objective_{i}" for i in range(len(objective_functions))
        )

    def objectives(self, trajectories: Sequence[Any]) -> FloatArray:
        """``[n, objectives]`` values of the objective functions."""
        if not self.objective_functions:
            raise ValueError("method 'pareto' needs objective_functions (ParetoRewardComputer)")
        return np.array([[float(f(t)) for f in self.objective_functions] for t in trajectories], dtype=np.float64)

    def compute_rewards(self, trajectories: Sequence[Any], method: Method = "absolute") -> FloatArray:
        """One reward per trajectory; ``relative`` and ``pareto`` compare members of the same ``group``.

        Trajectories that carry no ``group`` are compared with each other, as one group.
        """
        if method == "absolute":
            return np.array([float(self.reward_fn(t)) for t in trajectories], dtype=np.float64)
        out = np.zeros(len(trajectories))
        if method == "relative":
            absolute = self.compute_rewards(trajectories, "absolute")
            for idx in _by_group(trajectories).values():
                out[idx] = relative_ranks(absolute[idx])
            return out
        if method == "pareto":
            values = self.objectives(trajectories)
            for idx in _by_group(trajectories).values():
                out[idx] = pareto_scores(values[idx])
            return out
        raise ValueError(f"method must be 'absolute', 'relative' or 'pareto', got {method!r}")


class ParetoRewardComputer(RewardComputer):
    """Multi-objective rewards by non-dominated sorting + crowding distance (``method="pareto"`` by default)."""

    def __init__(
        self, objective_functions: Sequence[Callable[[Any], float]], objective_names: Sequence[str] = ()
    ) -> None:
        if not objective_functions:
            raise ValueError("ParetoRewardComputer needs at least one objective function")
        super().__init__(None, objective_functions, objective_names)

    def compute_rewards(self, trajectories: Sequence[Any], method: Method = "pareto") -> FloatArray:
        return super().compute_rewards(trajectories, method)


__all__ = [
    "Method",
    "ParetoRewardComputer",
    "RewardComputer",
    "crowding_distance",
    "dominance",
    "pareto_ranks",
    "pareto_scores",
    "relative_ranks",
]
