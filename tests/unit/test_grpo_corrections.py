"""Mismatch corrections (issue 38, acceptance 2): with a known injected trainer-inference mismatch, the corrected
policy-gradient estimate is closer to the exact on-policy gradient than the uncorrected one.

The policy is a softmax over 8 tokens with fixed logits and rewards, so the exact gradient of the expected reward
is known in closed form (``pi * (R - E_pi[R])``). The "engine" samples from another distribution ``mu``; the
estimators average ``w * R * grad log pi`` over 40,000 of its samples (fixed seed), ``w`` from
``grpo.losses.mismatch_weights`` (1 for the uncorrected estimate), through the trainer's own loss
(``clipped_surrogate`` with the trainer's logprobs as the behaviour policy, as ``BackpropModule`` runs it):

* a temperature mismatch (``mu`` sampled at temperature 1.5): truncated IS with a cap above every ratio is
  unbiased; its error is under a fifth of the uncorrected one's;
* a kernel-style corruption (two tokens' engine probabilities inflated 4x): IcePop's band [0.5, 2] drops exactly
  those tokens (ratio 0.36; the others' is 1.45); its error is under two thirds of the uncorrected one's;
* the same corruption in 3-token sequences: sequence-level masking (band [0.9, 1.6]) drops the sequences that hold
  a corrupted token (geometric-mean ratio 0.77 or less; the others' is 1.45);
  its error is under half of the uncorrected one's.
The margins are the test's, stated above; the measured errors are printed.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grpo.losses import clipped_surrogate, mismatch_weights  # noqa: E402

V, N = 8, 40_000
LOGITS = torch.tensor([1.2, 0.3, -0.5, 0.8, -1.0, 0.0, 0.5, -0.2], dtype=torch.float64)
REWARD = torch.tensor([0.1, 0.9, 0.4, 0.2, 1.0, 0.6, 0.0, 0.7], dtype=torch.float64)


def exact_gradient() -> torch.Tensor:
    pi = torch.softmax(LOGITS, 0)
    return pi * (REWARD - (pi * REWARD).sum())


def estimate(mu: torch.Tensor, mode: str, seq_len: int = 1, **kw: float) -> torch.Tensor:
    """The gradient the trainer's loss gives on ``N`` sequences sampled from ``mu`` with ``mode``'s weights."""
    gen = torch.Generator().manual_seed(0)
    actions = torch.multinomial(mu, N * seq_len, replacement=True, generator=gen).view(N, seq_len)
    theta = LOGITS.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)[actions]  # [N, seq_len], the trainer's logprobs
    engine = torch.log(mu)[actions]
    mask = torch.ones_like(logp, dtype=torch.bool)
    w = mismatch_weights(logp, engine, mask, mode, **kw)  # type: ignore[arg-type]
    adv = REWARD[actions].sum(1, keepdim=True).expand_as(logp) * w  # the sequence's reward on each of its tokens
    loss, _ = clipped_surrogate(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2, mode="token_mean")
    (loss * seq_len).backward()  # token_mean over N * seq_len tokens: a sequence's tokens are summed, as in the PG
    assert theta.grad is not None
    return -theta.grad


def errors(mu: torch.Tensor, mode: str, seq_len: int = 1, **kw: float) -> tuple[float, float]:
    want = exact_gradient() * seq_len  # E[sum_t R(a_t) * sum_t grad log pi(a_t)] for independent tokens
    none = float(torch.linalg.norm(estimate(mu, "none", seq_len) - want))
    corrected = float(torch.linalg.norm(estimate(mu, mode, seq_len, **kw) - want))
    print(f"\n{mode}: |error| uncorrected {none:.4f}, corrected {corrected:.4f} (|exact| {float(want.norm()):.4f})")
    return none, corrected


def corrupted() -> torch.Tensor:
    mu = torch.softmax(LOGITS, 0).clone()
    mu[[1, 4]] *= 4.0  # two tokens the engine over-samples (high-reward ones, so the bias shows)
    return mu / mu.sum()


def test_truncated_is_removes_a_temperature_mismatch() -> None:
    mu = torch.softmax(LOGITS / 1.5, 0)
    ratios = torch.softmax(LOGITS, 0) / mu
    assert float(ratios.max()) < 3.0  # the cap below is above every ratio: TIS is plain IS here, unbiased
    none, tis = errors(mu, "tis", cap=3.0)
    assert tis < none / 5


def test_icepop_band_drops_the_corrupted_tokens() -> None:
    mu = corrupted()
    r = torch.softmax(LOGITS, 0) / mu
    assert [i for i in range(V) if not 0.5 <= float(r[i]) <= 2.0] == [1, 4]  # exactly the corrupted ones leave
    none, mis = errors(mu, "mis", low=0.5, high=2.0)
    assert mis < none * 2 / 3  # the kept tokens still carry their ratio (1.45) unweighted: MIS trades bias for variance


def test_sequence_masking_drops_sequences_holding_a_corrupted_token() -> None:
    none, seq = errors(corrupted(), "seq_mask", seq_len=3, low=0.9, high=1.6)
    assert seq < none / 2


def test_weights_by_hand() -> None:
    t = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    e = torch.tensor([[-1.5, -1.0, -0.5], [-1.1, -0.9, -1.0]])
    m = torch.tensor([[True, True, False], [True, True, True]])
    r = np.exp((t - e).numpy())
    tis = mismatch_weights(t, e, m, "tis", cap=1.5)
    assert tis[0].tolist() == pytest.approx([1.5, float(r[0, 1]), 0.0])  # capped, kept, masked
    mis = mismatch_weights(t, e, m, "mis", low=0.5, high=1.5)
    assert mis.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # r = 1.65 and 0.37 leave the band
    seq = mismatch_weights(t, e, m, "seq_mask", low=0.9, high=1.1)
    # sequence 0: exp(mean(0.5, -1.0)) = 0.78 out; sequence 1: exp(mean(0.1, -0.1, 0)) = 1 in
    assert seq.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert mismatch_weights(t, e, m, "none").tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="unknown mismatch correction 'vtrace'"):
        mismatch_weights(t, e, m, "vtrace")  # type: ignore[arg-type]


def test_the_trainer_applies_a_correction_and_reports_what_it_kept() -> None:
    from grpo.backprop import BackpropConfig, BackpropModule
    from tests.unit.test_grpo_objectives import group_batch
    from tests.unit.test_grpo_policy import tiny_model

    model = tiny_model()
    module = BackpropModule(model, BackpropConfig(lr=1e-3, correction="mis", mis_low=0.9, mis_high=1.1))
    batch = group_batch(model, [1.0, 0.0, 0.0, 1.0])
    first = batch[0].tokens
    first.logprobs = first.logprobs.copy()
    first.logprobs[first.prompt_length] += 1.0  # one token the engine saw as e times likelier: outside the band
    advs = [np.full(len(b.tokens) - b.tokens.prompt_length, 1.0 - 2 * (i % 2)) for i, b in enumerate(batch)]
    stats = module.update(batch, advs)
    trained = stats["trained_tokens"]
    assert stats["correction/kept"] == pytest.approx((trained - 1) / trained, rel=1e-6)
    assert stats["grad_norm"] > 0 and stats["mismatch/out_0.9_1.1"] == pytest.approx(1 / trained)
