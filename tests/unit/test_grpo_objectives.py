"""GSPO, CISPO and OPO (issue 37): each against a hand computation on a fixed batch, and each selectable in the
trainer's config, where one update on a tiny random Llama trains (finite loss, non-zero gradient, ratio 1
on-policy). An unknown objective is refused naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from grpo import advantages as adv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo.backprop import BackpropConfig, BackpropModule  # noqa: E402
from grpo.losses import cispo_loss, clipped_surrogate, gspo_loss  # noqa: E402
from grpo.masks import ORIGIN_NAMES  # noqa: E402
from grpo.policy import group_forward  # noqa: E402
from tests.unit.test_grpo_policy import tiny_model  # noqa: E402

NAN = float("nan")


def t(rows: list[list[float]]) -> Any:
    return torch.tensor(rows, dtype=torch.float64)


# -- GSPO ------------------------------------------------------------------------------------------


def test_gspo_is_one_clipped_ratio_per_sequence() -> None:
    # seq 0: two trained tokens, log ratios +0.1 and -0.1 -> s0 = exp(0) = 1; its third token is masked (NaN old).
    # seq 1: three trained tokens, each log ratio +0.2 -> s1 = exp(0.2) = 1.2214, clipped to 1.2 at clip_high 0.2.
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]]).requires_grad_(True)
    old = t([[-1.1, -1.9, NAN], [-0.7, -0.7, -0.7]])
    a = t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, stats = gspo_loss(logp, old, a, mask, clip_low=0.2, clip_high=0.2)
    s1 = math.exp(0.2)
    # seq 0: -min(1 * 1, 1 * 1) = -1; seq 1: -min(s1 * -2, 1.2 * -2) = 2 * s1 (the unclipped term is the smaller)
    assert float(loss.detach()) == pytest.approx((-1.0 + 2.0 * s1) / 2, abs=1e-12)
    assert stats["clip_frac"] == 0.5 and stats["ratio_mean"] == pytest.approx((1.0 + s1) / 2)
    loss.backward()
    # d/dlogp: 1/2 (mean over 2 sequences) * -A * s * (1 / trained tokens of the sequence)
    want = [[-0.5 * 1.0 * 1.0 / 2] * 2 + [0.0], [0.5 * 2.0 * s1 / 3] * 3]
    np.testing.assert_allclose(logp.grad.numpy(), want, atol=1e-12)


def test_gspo_clipped_sequence_gets_no_gradient_and_empty_sequences_do_not_count() -> None:
    logp = t([[-0.5, -0.5], [-1.0, -1.0]]).requires_grad_(True)
    old = t([[-0.7, -0.7], [-1.0, -1.0]])
    a = t([[3.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[True, True], [False, False]])  # seq 1 trains nothing
    loss, stats = gspo_loss(logp, old, a, mask, clip_low=0.2, clip_high=0.2)
    # seq 0: s = exp(0.2) > 1.2 and A > 0: -min(s * 3, 1.2 * 3) = -3.6, a constant: no gradient
    assert float(loss.detach()) == pytest.approx(-3.6, abs=1e-12) and stats["clip_frac"] == 1.0
    loss.backward()
    assert not logp.grad.any()


# -- CISPO -----------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient() -> None:
    # token 0: ratio exp(0.5) = 1.6487 -> weight 1.28 (clip_high 0.28); token 1: ratio 1 -> weight 1.
    logp = t([[-1.0, -0.2]]).requires_grad_(True)
    old = t([[-1.5, -0.2]])
    a = t([[2.0, 2.0]])
    mask = torch.tensor([[True, True]])
    loss, stats = cispo_loss(logp, old, a, mask, clip_low=1.0, clip_high=0.28)
    # token mean of -w * A * logp: (-1.28 * 2 * -1.0 + -1 * 2 * -0.2) / 2 = (2.56 + 0.4) / 2
    assert float(loss.detach()) == pytest.approx(1.48, abs=1e-12)
    assert stats["clip_frac"] == 0.5
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-1.28 * 2 / 2, -1.0 * 2 / 2]], atol=1e-12)
    # the PPO surrogate on the same batch drops the clipped token's gradient entirely: CISPO's point
    logp2 = t([[-1.0, -0.2]]).requires_grad_(True)
    clip_loss, _ = clipped_surrogate(logp2, old, a, mask, clip_low=0.2, clip_high=0.28, mode="token_mean")
    clip_loss.backward()
    assert logp2.grad[0, 0] == 0 and logp2.grad[0, 1] != 0


def test_cispo_lower_bound_and_masked_tokens() -> None:
    logp = t([[-2.0, -1.0, -1.0]]).requires_grad_(True)
    old = t([[-1.0, NAN, -1.0]])  # ratio exp(-1) = 0.368; a masked NaN; ratio 1
    a = t([[1.0, 7.0, -1.0]])
    mask = torch.tensor([[True, False, True]])
    loss, _ = cispo_loss(logp, old, a, mask, clip_low=0.5, clip_high=0.28)
    # token 0's weight is raised to 1 - 0.5 = 0.5: (-0.5 * 1 * -2 + -1 * -1 * -1) / 2 = (1 - 1) / 2
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.5 / 2, 0.0, 1.0 / 2]], atol=1e-12)


# -- OPO -------------------------------------------------------------------------------------------


def test_opo_baseline_is_the_length_weighted_mean_reward() -> None:
    # b = (10 * 1 + 30 * 0 + 60 * 0) / 100 = 0.1, where the group mean (GRPO's baseline) is 1/3
    np.testing.assert_allclose(adv.opo([1.0, 0.0, 0.0], [10, 30, 60]), [0.9, -0.1, -0.1], atol=1e-12)
    np.testing.assert_allclose(adv.opo([1.0, 0.0], [0, 0]), [0.5, -0.5])  # no lengths: the plain mean
    assert adv.opo([1.0], [5]).tolist() == [0.0]  # a group of one carries no signal
    out = adv.group_advantages([1.0, 0.0, 0.5, 0.5, 1.0], ["a", "a", "b", "b", "a"], "opo", [10, 30, 4, 8, 60])
    # group a: b = (10 + 60) / 100 = 0.7; group b: all equal -> 0
    np.testing.assert_allclose(out, [0.3, -0.7, 0.0, 0.0, 0.3], atol=1e-12)


def test_opo_needs_lengths_and_checks_them() -> None:
    with pytest.raises(ValueError, match="needs each member's length"):
        adv.group_advantages([1.0, 0.0], ["g", "g"], "opo")
    with pytest.raises(ValueError, match="2 rewards but 3 lengths"):
        adv.opo([1.0, 0.0], [1, 2, 3])
    with pytest.raises(ValueError, match="lengths must be finite and >= 0"):
        adv.opo([1.0, 0.0], [1, -2])


# -- in the trainer --------------------------------------------------------------------------------


@dataclass
class Tokens:
    token_ids: np.ndarray
    prompt_length: int
    logprobs: np.ndarray
    loss_mask: np.ndarray
    origins: np.ndarray
    policy_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.token_ids)


def group_batch(model: Any, rewards: list[float]) -> list[Any]:
    """A group of completions of one prompt, with the model's own (on-policy) logprobs."""
    prompt = [5, 6, 7, 8]
    comps = [[11 + i, 20 + i, 30 + 2 * i][: 2 + i % 2] for i in range(len(rewards))]
    with torch.no_grad():
        lp = group_forward(model, prompt, [np.array(c) for c in comps]).logprobs.double().numpy()
    batch = []
    sampled, first = ORIGIN_NAMES.index("sampled"), ORIGIN_NAMES.index("prompt")
    for i, (c, r) in enumerate(zip(comps, rewards, strict=True)):
        n = len(prompt) + len(c)
        tokens = Tokens(
            np.array(prompt + c),
            len(prompt),
            np.concatenate([np.full(len(prompt), NAN), lp[i, : len(c)]]),
            np.array([False] * len(prompt) + [True] * len(c)),
            np.array([first] * len(prompt) + [sampled] * len(c), np.int8),
            np.zeros(n, np.int64),
        )
        batch.append(SimpleNamespace(tokens=tokens, reward=r, group="g"))
    return batch


@pytest.mark.parametrize(
    ("loss", "estimator", "extra"),
    [
        ("gspo", "grpo", {"clip_low": 3e-4, "clip_high": 4e-4}),
        ("cispo", "grpo", {"aggregation": "token_mean", "clip_low": 1.0, "clip_high": 0.28}),
        ("clip", "opo", {}),
    ],
)
def test_each_objective_is_selectable_and_trains(loss: str, estimator: str, extra: dict[str, Any]) -> None:
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    module = BackpropModule(model, BackpropConfig.model_validate({"loss": loss, "lr": 1e-3, **extra}))
    rewards = [1.0, 0.0, 0.0, 1.0]
    batch = group_batch(model, rewards)
    lengths = [int(m.sum()) for m in module.masks(batch, 0)]
    a = adv.group_advantages(rewards, ["g"] * 4, estimator, lengths if estimator == "opo" else None)  # type: ignore[arg-type]
    per_token = [np.full(len(b.tokens) - b.tokens.prompt_length, v) for b, v in zip(batch, a, strict=True)]
    stats = module.update(batch, per_token)
    assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and stats["trained_tokens"] == sum(lengths)
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the logprobs were the model's own
    assert any(not p.equal(q) for p, q in zip(model.parameters(), before, strict=True))


def test_an_unknown_objective_is_refused_naming_the_field() -> None:
    from grpo.cli import RLConfig

    with pytest.raises(ValidationError, match=r"trainer\.loss"):
        RLConfig.model_validate({"trainer": {"loss": "ppo2"}})
    with pytest.raises(ValidationError, match="estimator"):
        RLConfig.model_validate({"estimator": "gae"})
    assert RLConfig.model_validate({"estimator": "opo", "trainer": {"loss": "cispo"}}).trainer.loss == "cispo"
