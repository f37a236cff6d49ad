"""Loss masks from trajectories, and staleness filtering by policy version (``max_async_level``).

Invariants
----------
* A token is trained on only if the bridge marked it sampled (``loss_mask``) **and** its origin is not in
  ``exclude_origins`` (by default forced / env / prompt tokens never are, whatever the mask says).
* Staleness is measured per group, never per member: GRPO advantages are relative to the group, so a group
  is kept or dropped whole. A group's lag is ``trainer_version - oldest policy version`` over its trained
  tokens; ``lag <= max_async_level`` is kept with weight 1. Older groups are dropped (``mode="drop"``) or
  kept with weight ``decay ** (lag - max_async_level)`` (``mode="downweight"``); both are counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

ORIGIN_NAMES = ("unspecified", "prompt", "env", "sampled", "draft_accepted", "resampled", "forced")
DEFAULT_EXCLUDED: tuple[str, ...] = ("prompt", "env", "forced")


class TokenRecord(Protocol):
    """What ``rl_client.Trajectory`` provides (kept structural so tests can build small ones)."""

    loss_mask: npt.NDArray[np.bool_]
    origins: npt.NDArray[np.int8]
    policy_versions: npt.NDArray[np.int64]


def loss_mask(traj: TokenRecord, exclude_origins: Iterable[str] = DEFAULT_EXCLUDED) -> npt.NDArray[np.bool_]:
    """The trajectory's loss mask with tokens of the excluded origins switched off."""
    excluded = [ORIGIN_NAMES.index(o) for o in exclude_origins]
    mask = np.asarray(traj.loss_mask, dtype=bool).copy()
    if excluded:
        mask &= ~np.isin(np.asarray(traj.origins), excluded)
    return mask


def version_mask(traj: TokenRecord, trainer_version: int, max_async_level: int) -> npt.NDArray[np.bool_]:
    """Tokens sampled at most ``max_async_level`` policy versions before ``trainer_version`` (off-policy
    masking, token by token from the versions the bridge recorded; a multi-turn episode can straddle an update)."""
    return np.asarray(traj.policy_versions) >= trainer_version - max_async_level


def oldest_version(traj: TokenRecord, mask: npt.NDArray[np.bool_] | None = None) -> int | None:
    """The oldest policy version among the trained tokens (None when no token is trained)."""
    m = loss_mask(traj) if mask is None else mask
    versions = np.asarray(traj.policy_versions)[m]
    return int(versions.min()) if versions.size else None


@dataclass
class StalenessStats:
    """Counters since the filter was created (the trainer prints and records them)."""

    groups_kept: int = 0
    groups_dropped: int = 0
    groups_downweighted: int = 0
    samples_dropped: int = 0
    max_lag_seen: int = 0
    lags: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Verdict:
    keep: bool
    weight: float
    lag: int


class StalenessFilter:
    """Drop or down-weight groups generated more than ``max_async_level`` versions before the trainer's."""

    def __init__(self, max_async_level: int, mode: Literal["drop", "downweight"] = "drop", decay: float = 0.5) -> None:
        if max_async_level < 0:
            raise ValueError("max_async_level must be >= 0")
        if not 0.0 <= decay <= 1.0:
            raise ValueError("decay must be in [0, 1]")
        self.max_async_level = max_async_level
        self.mode = mode
        self.decay = decay
        self.stats = StalenessStats()

    def judge(self, group: Sequence[TokenRecord], trainer_version: int) -> Verdict:
        """Keep/drop one group and count it."""
        versions = [v for v in (oldest_version(t) for t in group) if v is not None]
        lag = max(0, trainer_version - min(versions)) if versions else 0
        self.stats.lags.append(lag)
        self.stats.max_lag_seen = max(self.stats.max_lag_seen, lag)
        if lag <= self.max_async_level:
            self.stats.groups_kept += 1
            return Verdict(True, 1.0, lag)
        if self.mode == "downweight":
            self.stats.groups_kept += 1
            self.stats.groups_downweighted += 1
            return Verdict(True, self.decay ** (lag - self.max_async_level), lag)
        self.stats.groups_dropped += 1
        self.stats.samples_dropped += len(group)
        return Verdict(False, 0.0, lag)


__all__ = [
    "DEFAULT_EXCLUDED",
    "ORIGIN_NAMES",
    "StalenessFilter",
    "StalenessStats",
    "TokenRecord",
    "Verdict",
    "loss_mask",
    "oldest_version",
    "version_mask",
]
