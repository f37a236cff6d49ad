"""grpo.rewards: Pareto ranks against a brute-force reference (hypothesis), crowding distance, the three
methods of ``RewardComputer`` (issue 23, acceptance 6)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo import ParetoRewardComputer, RewardComputer
from grpo.rewards import crowding_distance, pareto_ranks, pareto_scores


def brute_force_fronts(points: list[list[float]]) -> list[int]:
    """Front by definition: peel the points no remaining point dominates, repeatedly."""

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b, strict=True)) and a != b

    left = set(range(len(points)))
    front = [-1] * len(points)
    level = 0
    while left:
        top = {i for i in left if not any(dominates(points[j], points[i]) for j in left)}
        for i in top:
            front[i] = level
        left -= top
        level += 1
    return front


# Small integer grids make ties and duplicates common (the hard cases); floats cover the rest.
values = st.one_of(st.integers(0, 3).map(float), st.floats(-1e6, 1e6, allow_nan=False, width=32))
point_sets = st.integers(1, 4).flatmap(
    lambda m: st.lists(st.lists(values, min_size=m, max_size=m), min_size=1, max_size=30)
)


@settings(max_examples=300, deadline=None)
@given(point_sets)
def test_pareto_ranks_equal_the_brute_force_reference(points: list[list[float]]) -> None:
    assert pareto_ranks(points).tolist() == brute_force_fronts(points)


@settings(max_examples=200, deadline=None)
@given(point_sets)
def test_pareto_scores_order_fronts_and_stay_in_unit_interval(points: list[list[float]]) -> None:
    ranks = pareto_ranks(points)
    scores = pareto_scores(points)
    assert np.all((scores >= 0) & (scores <= 1))
    for i in range(len(points)):
        for j in range(len(points)):
            if ranks[i] < ranks[j]:
                assert scores[i] > scores[j]
    cd = crowding_distance(points, ranks)
    assert np.all(cd >= 0)


def test_crowding_distance_of_a_known_front() -> None:
    pts = [[0.0, 4.0], [1.0, 3.0], [3.0, 1.0], [4.0, 0.0]]  # one front, sorted by the first objective
    cd = crowding_distance(pts, pareto_ranks(pts))
    assert np.isinf(cd[0]) and np.isinf(cd[3])
    assert cd[1] == pytest.approx(3 / 4 + 3 / 4) and cd[2] == pytest.approx(3 / 4 + 3 / 4)


@dataclass
class T:
    reward: float
    group: int
    length: int = 0


def test_reward_computer_methods() -> None:
    batch = [T(0.2, 0), T(0.9, 0), T(0.9, 0), T(0.5, 1)]
    rc = RewardComputer()
    assert rc.compute_rewards(batch, "absolute").tolist() == [0.2, 0.9, 0.9, 0.5]
    assert rc.compute_rewards(batch, method="relative").tolist() == [0.0, 0.75, 0.75, 0.5]
    with pytest.raises(ValueError, match="objective_functions"):
        rc.compute_rewards(batch, "pareto")
    with pytest.raises(ValueError, match="method"):
        rc.compute_rewards(batch, "best")


def test_pareto_reward_computer_trades_objectives() -> None:
    batch = [T(1.0, 0, 50), T(1.0, 0, 10), T(0.0, 0, 5), T(0.0, 0, 60)]
    prc = ParetoRewardComputer(
        objective_functions=[lambda t: t.reward, lambda t: -t.length], objective_names=["correct", "brevity"]
    )
    r = prc.compute_rewards(batch)
    # (1, -10) dominates (1, -50); (0, -5) is on the first front too; (0, -60) is dominated by everyone
    assert r[1] == r[2] == 1.0 and r[1] > r[0] > r[3]
    assert prc.objective_names == ("correct", "brevity")
    with pytest.raises(ValueError):
        ParetoRewardComputer(objective_functions=[lambda t: 0.0], objective_names=["a", "b"])


@dataclass
class Ungrouped:
    reward: float
    length: int = 0


def test_trajectories_without_a_group_are_ranked_as_one_batch() -> None:
    batch = [Ungrouped(1.0, 50), Ungrouped(1.0, 10), Ungrouped(0.0, 5), Ungrouped(0.0, 60)]
    prc = ParetoRewardComputer(objective_functions=[lambda t: t.reward, lambda t: -t.length])
    r = prc.compute_rewards(batch, method="pareto")
    assert r[1] == r[2] == 1.0 and r[1] > r[0] > r[3]
    relative = RewardComputer().compute_rewards(batch, method="relative")
    assert relative.tolist() == pytest.approx([2.5 / 3, 2.5 / 3, 0.5 / 3, 0.5 / 3])
    # a batch mixing both: the grouped members rank among their group, the rest among themselves
    mixed = [T(0.2, 0), Ungrouped(0.3), T(0.9, 0), Ungrouped(0.1)]
    assert RewardComputer().compute_rewards(mixed, method="relative").tolist() == [0.0, 1.0, 1.0, 0.0]
