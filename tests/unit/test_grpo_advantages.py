"""grpo.advantages against independent reference formulas on 1,000 random groups (ties, G=1, all-equal).

The references are written out from the papers / TRL's ``GRPOTrainer`` with plain Python loops (no numpy
reductions shared with the implementation): GRPO = (r - mean) / (sample std + 1e-4) as TRL computes it with
``torch.std`` (Bessel-corrected); RLOO = r_i minus the explicit mean of the others; GAE = the closed-form
sum of discounted TD errors, sum_l (gamma*lam)^l delta_{t+l}.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from grpo import advantages as adv


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def ref_grpo(r: list[float]) -> list[float]:
    if len(r) == 1:
        return [0.0]  # documented: no baseline in a group of one
    m = _mean(r)
    std = math.sqrt(math.fsum((x - m) ** 2 for x in r) / (len(r) - 1))
    return [(x - m) / (std + 1e-4) for x in r]


def ref_dr_grpo(r: list[float]) -> list[float]:
    if len(r) == 1:
        return [0.0]
    m = _mean(r)
    return [x - m for x in r]


def ref_rloo(r: list[float]) -> list[float]:
    if len(r) == 1:
        return [0.0]
    return [x - _mean(r[:i] + r[i + 1 :]) for i, x in enumerate(r)]


def ref_gae(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    t_max = len(r)
    deltas = [r[t] + gamma * (v[t + 1] if t + 1 < t_max else 0.0) - v[t] for t in range(t_max)]
    return [math.fsum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, t_max)) for t in range(t_max)]


def random_groups(n: int, seed: int) -> list[list[float]]:
    """Groups of size 1..16 with binary, discrete (many ties), continuous and all-equal rewards."""
    rng = random.Random(seed)
    groups: list[list[float]] = []
    for i in range(n):
        g = rng.choice([1, 1, 2, 3, 4, 8, 16]) if i % 10 else 1
        kind = i % 4
        if kind == 0:
            groups.append([float(rng.random() < 0.5) for _ in range(g)])
        elif kind == 1:
            groups.append([rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(g)])
        elif kind == 2:
            groups.append([rng.uniform(-5, 5) for _ in range(g)])
        else:
            groups.append([rng.choice([0.0, 1.0, 0.3])] * g)
    return groups


GROUPS = random_groups(1000, seed=8)


def test_the_random_groups_cover_the_edge_cases() -> None:
    assert len(GROUPS) == 1000
    assert sum(len(g) == 1 for g in GROUPS) >= 100
    assert sum(len(g) > 1 and len(set(g)) == 1 for g in GROUPS) >= 100
    assert sum(len(set(g)) < len(g) and len(set(g)) > 1 for g in GROUPS) >= 100  # ties but not all equal


@pytest.mark.parametrize(
    ("fn", "ref"), [(adv.grpo, ref_grpo), (adv.dr_grpo, ref_dr_grpo), (adv.rloo, ref_rloo)], ids=["grpo", "dr", "rloo"]
)
def test_group_estimators_match_the_reference_on_1000_groups(fn, ref) -> None:  # type: ignore[no-untyped-def]
    for r in GROUPS:
        got = fn(r)
        assert np.all(np.isfinite(got)), r
        np.testing.assert_allclose(got, ref(r), rtol=1e-9, atol=1e-9, err_msg=str(r))


def test_edge_cases_are_zero_not_nan() -> None:
    for fn in (adv.grpo, adv.dr_grpo, adv.rloo):
        assert fn([0.7]).tolist() == [0.0]
        assert fn([0.3] * 8).tolist() == [0.0] * 8
        assert fn([]).tolist() == []
    # ties share one advantage; a binary group of 4 with one success: the success is the only positive
    a = adv.grpo([1.0, 0.0, 0.0, 0.0])
    assert a[0] > 0 and a[1] == a[2] == a[3] < 0
    with pytest.raises(ValueError):
        adv.grpo([1.0, float("nan")])


def test_flat_batch_grouping_equals_per_group_calls() -> None:
    rewards: list[float] = []
    ids: list[int] = []
    for gi, r in enumerate(GROUPS[:200]):
        rewards += r
        ids += [gi] * len(r)
    order = np.random.default_rng(0).permutation(len(rewards))  # members need not be contiguous
    shuffled_r = [rewards[i] for i in order]
    shuffled_ids = [ids[i] for i in order]
    for est, ref in (("grpo", ref_grpo), ("dr_grpo", ref_dr_grpo), ("rloo", ref_rloo)):
        got = adv.group_advantages(shuffled_r, shuffled_ids, est)  # type: ignore[arg-type]
        # the estimators are permutation-equivariant: sample i's advantage is the reference at its group position
        ref_by_group = {gi: ref(r) for gi, r in enumerate(GROUPS[:200])}
        position = [i - ids.index(ids[i]) for i in range(len(rewards))]
        expected = [ref_by_group[ids[i]][position[i]] for i in order]
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


def test_gae_matches_the_closed_form() -> None:
    rng = random.Random(3)
    for _ in range(1000):
        t_max = rng.randint(1, 12)
        r = [rng.uniform(-1, 1) if rng.random() < 0.5 else 0.0 for _ in range(t_max)]
        v = [rng.uniform(-1, 1) for _ in range(t_max)]
        gamma, lam = rng.choice([1.0, 0.99, 0.9]), rng.choice([1.0, 0.95, 0.0])
        a, ret = adv.gae(r, v, gamma=gamma, lam=lam)
        np.testing.assert_allclose(a, ref_gae(r, v, gamma, lam), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(ret, np.asarray(a) + np.asarray(v), rtol=1e-12)
    # lam = 1, gamma = 1: the advantage is the Monte-Carlo return minus the value
    a, _ = adv.gae([0.0, 0.0, 1.0], [0.2, 0.5, 0.9], gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a, [0.8, 0.5, 0.1])


def test_broadcast_puts_the_advantage_on_masked_tokens_only() -> None:
    masks = [np.array([0, 0, 1, 1, 0, 1], bool), np.array([1, 0], bool)]
    out = adv.broadcast_to_tokens([0.5, -2.0], masks)
    assert out[0].tolist() == [0, 0, 0.5, 0.5, 0, 0.5]
    assert out[1].tolist() == [-2.0, 0]
