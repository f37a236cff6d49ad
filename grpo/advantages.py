"""Advantage estimators: GRPO, Dr. GRPO, RLOO, OPO (group baselines) and GAE (PPO), plus token broadcasting.

All functions are numpy, float64 inside, and never return NaN or inf for finite inputs.

Documented edge cases (the tests check every one):

* **G = 1** (a group of one): every group estimator returns 0 — there is no baseline to compare with, so
  the sample carries no learning signal (TRL's unbiased std would be NaN here).
* **All-equal rewards** (including ties of the whole group): 0 for every member; GRPO divides by
  ``std + eps`` and the numerator is exactly 0.
* **Ties** inside a group are ordinary values: equal rewards get equal advantages.

Formulas (``r`` = rewards of one group of size G, ``mean``/``std`` over the group):

* GRPO (Shao et al. 2024, TRL ``GRPOTrainer``): ``(r_i - mean) / (std + eps)`` with the unbiased std
  (ddof=1, as ``torch.std``) and ``eps = 1e-4``; ``scale="none"`` gives Dr. GRPO.
* Dr. GRPO (Liu et al. 2025): ``r_i - mean``; no std, and the loss is not length-normalised
  (``grpo.losses.aggregate(..., mode="constant")``).
* RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j`` = ``G/(G-1) * (r_i - mean)``.
* OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): ``r_i - b``, ``b = sum_j L_j r_j / sum_j
  L_j`` with ``L_j`` the length of member ``j``'s response (its trained tokens): the baseline that minimises the
  gradient variance when each token's gradient has about the same norm; meant for exactly on-policy training.
  Without lengths (or all zero) it is the group mean (Dr. GRPO).
* GAE (Schulman et al. 2016): ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_T = 0`` after the last
  step), ``A_t = delta_t + gamma * lam * A_{t+1}``; returns = ``A + V``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
Estimator = Literal["grpo", "dr_grpo", "rloo", "opo"]

GRPO_EPS = 1e-4


def _as_group(rewards: Sequence[float] | npt.ArrayLike) -> FloatArray:
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def grpo(rewards: Sequence[float] | npt.ArrayLike, *, eps: float = GRPO_EPS, scale: bool = True) -> FloatArray:
    """GRPO advantages of one group: ``(r - mean) / (std_unbiased + eps)`` (``scale=False``: Dr. GRPO)."""
    r = _as_group(rewards)
    if r.size <= 1:
        return np.zeros_like(r)
    centred = r - r.mean()
    if not scale:
        return centred
    return centred / (r.std(ddof=1) + eps)


def dr_grpo(rewards: Sequence[float] | npt.ArrayLike) -> FloatArray:
    """Dr. GRPO advantages of one group: ``r - mean`` (no std normalisation)."""
    return grpo(rewards, scale=False)


def rloo(rewards: Sequence[float] | npt.ArrayLike) -> FloatArray:
    """RLOO advantages of one group: each reward minus the mean of the *other* members."""
    r = _as_group(rewards)
    g = r.size
    if g <= 1:
        return np.zeros_like(r)
    return (r - r.mean()) * (g / (g - 1))


def opo(rewards: Sequence[float] | npt.ArrayLike, lengths: Sequence[float] | npt.ArrayLike) -> FloatArray:
    """OPO advantages of one group: each reward minus the length-weighted mean reward of the group."""
    r = _as_group(rewards)
    n = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if n.size != r.size:
        raise ValueError(f"{r.size} rewards but {n.size} lengths")
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ValueError(f"lengths must be finite and >= 0, got {n.tolist()}")
    if r.size <= 1:
        return np.zeros_like(r)
    baseline = float(np.dot(n, r) / n.sum()) if n.sum() > 0 else float(r.mean())
    return r - baseline


def group_advantages(
    rewards: Sequence[float] | npt.ArrayLike,
    group_ids: Sequence[object],
    estimator: Estimator = "grpo",
    lengths: Sequence[float] | npt.ArrayLike | None = None,
) -> FloatArray:
    """Advantages for a flat batch whose members are grouped by ``group_ids`` (any hashable per sample);
    ``lengths`` (each member's trained tokens) are OPO's weights and required for it."""
    r = _as_group(rewards)
    if len(group_ids) != r.size:
        raise ValueError(f"{r.size} rewards but {len(group_ids)} group ids")
    if estimator == "opo" and lengths is None:
        raise ValueError("the opo estimator needs each member's length (its trained tokens)")
    n = np.zeros_like(r) if lengths is None else np.asarray(lengths, dtype=np.float64).reshape(-1)
    out = np.zeros_like(r)
    index: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for members in index.values():
        if estimator == "opo":
            out[members] = opo(r[members], n[members])
        else:
            out[members] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}[estimator](r[members])
    return out


def gae(
    rewards: Sequence[float] | npt.ArrayLike,
    values: Sequence[float] | npt.ArrayLike,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_value: float = 0.0,
) -> tuple[FloatArray, FloatArray]:
    """GAE over one trajectory of T steps: returns ``(advantages, returns)``, each of length T.

    ``last_value`` bootstraps a truncated trajectory (0 for a terminal one).
    """
    r = _as_group(rewards)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size != r.size:
        raise ValueError(f"{r.size} rewards but {v.size} values")
    adv = np.zeros_like(r)
    running = 0.0
    next_value = float(last_value)
    for t in range(r.size - 1, -1, -1):
        delta = r[t] + gamma * next_value - v[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = v[t]
    return adv, adv + v


def broadcast_to_tokens(
    advantages: Sequence[float] | npt.ArrayLike, masks: Sequence[npt.ArrayLike]
) -> list[FloatArray]:
    """Per-token advantages: sample ``i``'s advantage on every token its mask selects, 0 elsewhere."""
    a = np.asarray(advantages, dtype=np.float64).reshape(-1)
    if a.size != len(masks):
        raise ValueError(f"{a.size} advantages but {len(masks)} masks")
    return [np.where(np.asarray(m, dtype=bool), a[i], 0.0) for i, m in enumerate(masks)]


__all__ = ["GRPO_EPS", "Estimator", "broadcast_to_tokens", "dr_grpo", "gae", "group_advantages", "grpo", "rloo"]
