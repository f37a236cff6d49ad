"""The trainer-inference mismatch monitor (issue 38, acceptance 1): figures checked against a hand computation on a
fixed batch, in the monitor alone and through ``BackpropModule.update`` on a tiny model."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest

from grpo.masks import ORIGIN_NAMES
from grpo.mismatch import MismatchMonitor

SAMPLED, DRAFT = ORIGIN_NAMES.index("sampled"), ORIGIN_NAMES.index("draft_accepted")


def k3(d: float) -> float:
    return math.exp(d) - 1.0 - d


def test_figures_equal_a_hand_computation() -> None:
    m = MismatchMonitor()
    # trajectory 1: three on-policy sampled tokens, one draft token; trajectory 2: two tokens one version old
    m.add([-1.0, -2.0, -0.5, -0.3], [-1.0, -2.2, -0.45, -1.0], [SAMPLED, SAMPLED, SAMPLED, DRAFT], [3, 3, 3, 3], 3)
    m.add([-0.1, -3.0], [-0.2, -2.0], [SAMPLED, SAMPLED], [2, 2], 3)
    f = m.figures()
    on = [0.0, 0.2, -0.05, 0.7]  # trainer - engine, the lag-0 tokens
    assert f["mismatch/tokens"] == 4
    assert f["mismatch/k3_kl"] == pytest.approx(sum(k3(d) for d in on) / 4, rel=1e-12)
    assert f["mismatch/abs_mean"] == pytest.approx((0 + 0.2 + 0.05 + 0.7) / 4)
    assert f["mismatch/abs_max"] == pytest.approx(0.7)
    # ratios exp(d): 1, 1.221, 0.951, 2.014: two leave [0.9, 1.1], one leaves [0.5, 2]
    assert f["mismatch/out_0.9_1.1"] == pytest.approx(2 / 4) and f["mismatch/out_0.5_2"] == pytest.approx(1 / 4)
    assert f["mismatch/sampled/tokens"] == 3 and f["mismatch/draft_accepted/tokens"] == 1
    assert f["mismatch/draft_accepted/abs_max"] == pytest.approx(0.7)
    assert f["mismatch/sampled/k3_kl"] == pytest.approx((k3(0.0) + k3(0.2) + k3(-0.05)) / 3, rel=1e-12)
    assert f["mismatch/lag1/tokens"] == 2  # drift + mismatch, kept apart from the on-policy figures
    assert f["mismatch/lag1/abs_mean"] == pytest.approx((0.1 + 1.0) / 2)
    assert f["mismatch/lag1/out_0.5_2"] == pytest.approx(1 / 2)  # exp(-1) = 0.37


def test_nothing_on_policy_is_nan_not_zero() -> None:
    m = MismatchMonitor()
    m.add([-1.0], [-1.5], [SAMPLED], [0], 2)
    f = m.figures()
    assert f["mismatch/tokens"] == 0 and math.isnan(f["mismatch/k3_kl"])
    assert f["mismatch/lag2/k3_kl"] == pytest.approx(k3(0.5))


def test_the_trainer_reports_the_mismatch_it_trains_with() -> None:
    pytest.importorskip("torch")
    from grpo.backprop import BackpropConfig, BackpropModule
    from tests.unit.test_grpo_objectives import group_batch
    from tests.unit.test_grpo_policy import tiny_model

    model = tiny_model()
    module = BackpropModule(model, BackpropConfig(lr=1e-3))
    batch = group_batch(model, [1.0, 0.0, 0.0, 1.0])  # the engine logprobs are the model's own: no mismatch
    rng = np.random.default_rng(0)
    shifts = []
    for b in batch:  # inject a known mismatch on the sampled tokens
        p = b.tokens.prompt_length
        s = rng.normal(0.0, 0.05, len(b.tokens) - p)
        b.tokens.logprobs = b.tokens.logprobs.copy()
        b.tokens.logprobs[p:] -= s  # trainer - engine = s
        shifts.append(s)
    d = np.concatenate(shifts)
    advs = [np.full(len(b.tokens) - b.tokens.prompt_length, 1.0 - 2 * (i % 2)) for i, b in enumerate(batch)]
    stats = module.update(batch, advs)
    assert stats["mismatch/tokens"] == d.size
    assert stats["mismatch/k3_kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-4)
    assert stats["mismatch/abs_max"] == pytest.approx(float(np.abs(d).max()), rel=1e-4)
    assert stats["mismatch/out_0.9_1.1"] == pytest.approx(float(np.mean((np.exp(d) < 0.9) | (np.exp(d) > 1.1))))
    assert stats["mismatch/sampled/tokens"] == d.size


def test_a_step_past_the_threshold_is_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from grpo.algorithms import AlgorithmConfig, GRPOAlgorithm
    from grpo.backprop import BackpropConfig, BackpropModule
    from grpo.trainer import Offline
    from tests.unit.test_grpo_objectives import group_batch
    from tests.unit.test_grpo_policy import tiny_model

    model = tiny_model()
    algo = GRPOAlgorithm(
        Offline(0), None, BackpropModule(model, BackpropConfig(lr=1e-3)), AlgorithmConfig(out_dir=str(tmp_path))
    )  # type: ignore[arg-type]
    batch = group_batch(model, [1.0, 0.0, 0.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="primerl.rl"):
        stats = algo.learn(batch, save_weights=False)  # on-policy: the engine logprobs are the model's own
    assert stats["mismatch/k3_kl"] < 1e-9 and "trainer-inference k3 KL" not in caplog.text
    batch = group_batch(model, [1.0, 0.0, 0.0, 1.0])  # the updated model's own logprobs, then shifted
    for b in batch:
        b.tokens.logprobs = b.tokens.logprobs.copy()
        b.tokens.logprobs[b.tokens.prompt_length :] -= 0.2  # every token: r = e^0.2, k3 = 0.0214
    algo.step = 4
    with caplog.at_level(logging.WARNING, logger="primerl.rl"):
        stats = algo.learn(batch, save_weights=False)
    assert stats["mismatch/k3_kl"] == pytest.approx(math.exp(0.2) - 1.2, rel=1e-3)
    assert "step 5: trainer-inference k3 KL 0.0214 > mismatch_warn_kl 0.001" in caplog.text
