"""grpo.masks: loss masks with origins excluded, staleness verdicts per group, pipeline admission bound."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from grpo.masks import ORIGIN_NAMES, StalenessFilter, loss_mask, oldest_version
from grpo.pipeline import Pipeline


@dataclass
class Traj:
    loss_mask: np.ndarray
    origins: np.ndarray
    policy_versions: np.ndarray


def traj(origins: list[str], mask: list[int], versions: list[int]) -> Traj:
    return Traj(
        np.array(mask, bool), np.array([ORIGIN_NAMES.index(o) for o in origins], np.int8), np.array(versions, np.int64)
    )


def test_loss_mask_excludes_forced_env_and_prompt_tokens_even_if_marked() -> None:
    t = traj(
        ["prompt", "prompt", "sampled", "sampled", "env", "forced", "draft_accepted", "resampled"],
        [0, 1, 1, 1, 1, 1, 1, 1],
        [0] * 8,
    )
    assert loss_mask(t).tolist() == [False, False, True, True, False, False, True, True]
    assert loss_mask(t, exclude_origins=()).tolist() == [False, True, True, True, True, True, True, True]
    assert loss_mask(t, exclude_origins=("draft_accepted",)).tolist()[6] is False


def test_oldest_version_looks_at_trained_tokens_only() -> None:
    t = traj(["prompt", "sampled", "env", "sampled"], [0, 1, 0, 1], [0, 5, 3, 6])
    assert oldest_version(t) == 5
    assert oldest_version(traj(["prompt"], [0], [0])) is None


def test_filter_keeps_within_level_and_drops_beyond_counting_samples() -> None:
    f = StalenessFilter(max_async_level=2)
    fresh = [traj(["sampled"], [1], [8]), traj(["sampled"], [1], [9])]
    old = [traj(["sampled", "sampled"], [1, 1], [6, 7]), traj(["sampled"], [1], [9])]  # one old member -> group lag 4
    assert f.judge(fresh, 10).keep and f.judge(fresh, 10).lag == 2
    v = f.judge(old, 10)
    assert not v.keep and v.lag == 4 and v.weight == 0.0
    assert f.stats.groups_dropped == 1 and f.stats.samples_dropped == 2 and f.stats.max_lag_seen == 4
    with pytest.raises(ValueError):
        StalenessFilter(-1)


def test_downweight_mode_decays_per_version_beyond_the_level() -> None:
    f = StalenessFilter(max_async_level=1, mode="downweight", decay=0.5)
    g = [traj(["sampled"], [1], [2])]
    assert f.judge(g, 3).weight == 1.0
    assert f.judge(g, 5).weight == 0.25
    assert f.stats.groups_downweighted == 1 and f.stats.groups_dropped == 0


@pytest.mark.parametrize("level", [0, 1, 3])
async def test_pipeline_admission_never_runs_ahead_of_the_level(level: int) -> None:
    pipe: Pipeline[int] = Pipeline(level, base_version=7)
    events: list[tuple[str, int, int]] = []

    async def collect(step: int) -> int:
        events.append(("collect", step, pipe.version))
        await asyncio.sleep(0.001)
        return pipe.version  # the "policy version" the batch was sampled with

    async def train(step: int, sampled_with: int) -> int:
        assert pipe.version - sampled_with <= level
        events.append(("train", step, pipe.version))
        await asyncio.sleep(0.01)
        return pipe.version + 1

    await pipe.run(0, 8, collect, train)
    assert [e[1] for e in events if e[0] == "train"] == list(range(8))
    assert all(v >= 7 + s - level for s, v in pipe.admitted_at.items())
    lags = [t[2] - c[2] for c in events if c[0] == "collect" for t in events if t[0] == "train" and t[1] == c[1]]
    assert max(lags) == min(level, 7)  # the bound is reached: async really runs ahead
