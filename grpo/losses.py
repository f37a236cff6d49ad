"""Policy losses (torch): the clipped surrogate (PPO/GRPO), prime-rl's token-level importance-sampling objective
(AIPO), GSPO's sequence-level ratio and clipping, CISPO's clipped importance weights, the k3 KL estimator, the
clipped value loss, and the per-token weights that correct for a trainer-inference mismatch (TIS, MIS/IcePop,
sequence-level masking).

Inputs are ``[batch, tokens]`` tensors with a boolean ``mask`` of the tokens to train on. Aggregation:

* ``"seq_mean"`` (GRPO): mean over each sequence's masked tokens, then mean over sequences;
* ``"token_mean"`` (DAPO): sum over all masked tokens / their count;
* ``"constant"`` (Dr. GRPO): sum over masked tokens / (batch * ``norm_tokens``) — no length bias.

A batch whose mask is empty gives a zero loss that still has a graph (so ``backward`` is always safe).
Masked positions never reach the loss or its gradient, whatever they hold (``torch.where``, not ``* mask``).
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["seq_mean", "token_mean", "constant"]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm_tokens: int = 0) -> torch.Tensor:
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if mode == "constant":
        return (per_token * m).sum() / (per_token.shape[0] * max(1, norm_tokens or per_token.shape[1]))
    per_seq = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_seq.mean()


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: torch.Tensor | None = None,
    mode: Aggregation = "seq_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/GRPO loss ``-min(ratio*A, clip(ratio, 1-low, 1+high)*A)``; ``weights`` scale whole sequences."""
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    # Masked positions (env/prompt tokens, padding) may hold any old logprob (0, -inf, NaN): select, never
    # multiply, so that inf * 0 cannot turn into NaN in the loss or its gradient.
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages, zero)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = torch.where(m, -torch.minimum(unclipped, clipped), zero)
    if weights is not None:
        per_token = per_token * weights[:, None]
    loss = aggregate(per_token, mask, mode)
    with torch.no_grad():
        n = max(1, int(m.sum()))
        stats = {
            "clip_frac": float(((unclipped != clipped) & m).sum()) / n,
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
        }
    return loss, stats


def token_is_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    mode: Aggregation = "seq_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """prime-rl's token-level importance-sampling objective with clipping (AIPO, Tang et al. 2025).

    ``-min(ratio, cap).detach() * A * logprob`` per token: the policy gradient of tokens sampled by an older
    policy (``old_logprobs`` are the bridge's), each weighted by its truncated importance ratio. The weight
    carries no gradient, so a stale token can never push its own ratio past ``cap``; tokens too stale to
    correct at all are masked out beforehand (``grpo.masks.version_mask``).
    """
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=cap).detach()
    per_token = torch.where(m, -weight * torch.where(m, advantages, zero) * logprobs, zero)
    loss = aggregate(per_token, mask, mode)
    with torch.no_grad():
        n = max(1, int(m.sum()))
        stats = {
            "clip_frac": float(((ratio > cap) & m).sum()) / n,
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
        }
    return loss, stats


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros_like(logprobs)
    return torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero).clamp(-20.0, 20.0)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per sequence.

    ``s_i = exp(mean_t(logp - old_logp))`` over the sequence's trained tokens (the length-normalised sequence
    likelihood ratio); loss ``-min(s_i * A_i, clip(s_i, 1 - low, 1 + high) * A_i)``, mean over the sequences
    that have a trained token. ``A_i`` is the mean of the sequence's token advantages (GRPO's are constant per
    sequence). The paper's clip range is small (3e-4 / 4e-4): a sequence ratio moves far less than a token's.
    Sequences without a trained token contribute nothing (and are not counted).
    """
    m = mask.bool()
    n_tok = m.sum(dim=1)
    has = n_tok > 0
    denom = n_tok.clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = _log_ratio(logprobs, old_logprobs, m).sum(dim=1) / denom
    ratio = torch.exp(seq_log_ratio)
    adv = torch.where(m, advantages, torch.zeros_like(advantages)).sum(dim=1) / denom
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_seq = torch.where(has, -torch.minimum(unclipped, clipped), torch.zeros_like(ratio))
    loss = per_seq.sum() / has.sum().clamp(min=1).to(per_seq.dtype)
    with torch.no_grad():
        k = max(1, int(has.sum()))
        stats = {
            "clip_frac": float(((unclipped != clipped) & has).sum()) / k,
            "ratio_mean": float(ratio[has].mean()) if has.any() else 1.0,
        }
    return loss, stats


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    mode: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, never the token.

    ``-sg(clip(ratio, 1 - low, 1 + high)) * A * logp`` per token: unlike the PPO surrogate, whose clipped tokens
    get no gradient at all, every trained token keeps its policy gradient, scaled by its bounded, detached
    weight. MiniMax-M1 leaves the lower bound open (``low = 1``: the weight only has to stay >= 0) and tunes the
    upper; the loss is a mean over all trained tokens of the batch (``token_mean``).
    """
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, m))
    weight = torch.clamp(ratio, max(0.0, 1.0 - clip_low), 1.0 + clip_high).detach()
    per_token = torch.where(m, -weight * torch.where(m, advantages, zero) * logprobs, zero)
    loss = aggregate(per_token, mask, mode)
    with torch.no_grad():
        n = max(1, int(m.sum()))
        stats = {
            "clip_frac": float(((weight != ratio) & m).sum()) / n,
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
        }
    return loss, stats


Correction = Literal["none", "tis", "mis", "seq_mask"]


def mismatch_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: Correction,
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Per-token weights (no gradient) that correct for the engine having sampled from another distribution than
    the one the trainer computes, ``r = exp(trainer - engine)`` per token:

    * ``"tis"``: truncated importance sampling, ``min(r, cap)`` (prime-rl's and verl's TIS; Yao et al. 2025);
    * ``"mis"``: masked importance sampling, 1 where ``low <= r <= high`` and 0 outside (IcePop's two-sided band);
    * ``"seq_mask"``: 1 for every token of a sequence whose geometric-mean ratio ``exp(mean log r)`` over its
      masked tokens lies in ``[low, high]``, 0 for every token of the others;
    * ``"none"``: 1.

    The trainer multiplies each token's advantage by its weight and takes its own logprobs (no gradient) as the
    behaviour policy of the clipped ratio, so the ratio measures the update and the weight the mismatch.
    """
    m = mask.bool()
    with torch.no_grad():
        log_r = torch.where(m, trainer_logprobs.detach() - engine_logprobs, torch.zeros_like(engine_logprobs))
        if mode == "tis":
            w = torch.exp(log_r).clamp(max=cap)
        elif mode == "mis":
            r = torch.exp(log_r)
            w = ((r >= low) & (r <= high)).to(log_r.dtype)
        elif mode == "seq_mask":
            mf = m.to(log_r.dtype)
            g = torch.exp((log_r * mf).sum(dim=1) / mf.sum(dim=1).clamp(min=1.0))
            w = ((g >= low) & (g <= high)).to(log_r.dtype).unsqueeze(1).expand_as(log_r)
        elif mode == "none":
            w = torch.ones_like(log_r)
        else:
            raise ValueError(f"unknown mismatch correction {mode!r}: none, tis, mis or seq_mask")
        return torch.where(m, w, torch.zeros_like(w))


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman): ``exp(r) - r - 1``, ``r = ref - logp``."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """Clipped value loss (PPO2): ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``, token mean."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return aggregate(per_token, mask, "token_mean")


__all__ = [
    "Aggregation",
    "Correction",
    "aggregate",
    "cispo_loss",
    "clipped_surrogate",
    "gspo_loss",
    "kl_k3",
    "mismatch_weights",
    "token_is_loss",
    "value_loss",
]
