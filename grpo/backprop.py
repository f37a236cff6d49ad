"""``BackpropModule``: one optimizer step of a policy (and value head) from a batch of trajectories.

The forward pass is ``grpo.policy.group_forward`` per group of trajectories that share a prompt (the prompt
runs once), at the sampling temperature, so the on-policy ratio is 1. Trained tokens: the bridge's loss mask
less prompt/env/forced origins (``grpo.masks.loss_mask``) and, off-policy, less every token sampled more than
``max_async_level`` policy versions before the trainer's (``grpo.masks.version_mask``).

Policy losses (``loss``, all in ``grpo.losses``): ``"clip"`` the PPO/GRPO clipped surrogate; ``"aipo"`` prime-rl's
token-level importance-sampling objective (``token_is_loss``); ``"gspo"`` one clipped ratio per sequence
(``gspo_loss``; set ``clip_low``/``clip_high`` to the paper's 3e-4/4e-4); ``"cispo"`` clipped, detached
importance weights on every token's policy gradient (``cispo_loss``; ``aggregation = "token_mean"`` as MiniMax-M1).

KL to a reference model (k3) when ``kl_coef > 0``; the reference is frozen (``ref_update="none"``), an EMA of
the policy (``"ema"``) or a copy refreshed every ``ref_interval`` updates (``"copy"``). With a value head (PPO):
GAE over the trained tokens (reward on the last one), the clipped value loss, a separate optimizer on detached
hidden states.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from grpo import advantages as adv
from grpo.losses import (
    Aggregation,
    Correction,
    aggregate,
    cispo_loss,
    clipped_surrogate,
    gspo_loss,
    kl_k3,
    mismatch_weights,
    token_is_loss,
    value_loss,
)
from grpo.masks import loss_mask, version_mask
from grpo.mismatch import MismatchMonitor
from grpo.policy import GroupForward, group_forward, invariant_group_forward, pad_right

FloatArray = npt.NDArray[np.float64]


class BackpropConfig(BaseModel):
    """The optimizer, the losses and the reference model."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(2e-5, gt=0, description="AdamW learning rate of the policy.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping (global norm).")
    loss: Literal["clip", "aipo", "gspo", "cispo"] = Field(
        "clip",
        description="clip: PPO/GRPO surrogate; aipo: token-level IS (prime-rl); gspo: sequence-level ratio and "
        "clip (Zheng et al. 2025); cispo: clipped IS weights, every token's gradient kept (MiniMax-M1).",
    )
    clip_low: float = Field(0.2, ge=0, description="Lower ratio clip (1 - clip_low).")
    clip_high: float = Field(0.2, ge=0, description="Upper ratio clip (1 + clip_high).")
    is_cap: float = Field(2.0, gt=0, description="aipo: cap of the importance weight.")
    aggregation: Aggregation = Field("seq_mean", description="seq_mean (GRPO), token_mean (DAPO), constant (Dr.GRPO).")
    temperature: float = Field(1.0, gt=0, description="Temperature the tokens were sampled at.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference model (0 = no reference).")
    ref_update: Literal["none", "ema", "copy"] = Field("none", description="How the reference follows the policy.")
    ref_ema_decay: float = Field(0.99, ge=0, le=1, description="ema: ref = decay * ref + (1 - decay) * policy.")
    ref_interval: int = Field(10, ge=1, description="copy: refresh the reference every this many updates.")
    normalize_advantages: bool = Field(False, description="Normalise token advantages over the batch.")
    max_async_level: int = Field(1_000_000, ge=0, description="Mask tokens sampled more versions ago than this.")
    value_lr: float = Field(1e-3, gt=0, description="Value head learning rate (PPO).")
    value_clip: float = Field(0.2, ge=0, description="Clip of the value update (PPO2 value loss).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    correction: Correction = Field(
        "none",
        description="Trainer-inference mismatch correction (grpo.losses.mismatch_weights): none, tis (truncated "
        "importance sampling), mis (IcePop's masked band) or seq_mask (a sequence's geometric-mean ratio).",
    )
    tis_cap: float = Field(2.0, gt=0, description="tis: cap C of the trainer/engine ratio.")
    mis_low: float = Field(0.5, gt=0, description="mis, seq_mask: lower bound of the kept ratio band.")
    mis_high: float = Field(2.0, gt=0, description="mis, seq_mask: upper bound of the kept ratio band.")
    batch_invariant: bool = Field(
        False,
        description="Forward with engines.embedded.invariant (fixed-shape chunks, float64 logprobs): bit for bit "
        "the logprobs of an embedded engine in its batch_invariant mode under the same weights.",
    )
    mismatch_warn_kl: float = Field(
        1e-3, ge=0, description="Warn when a step's trainer-inference k3 KL (grpo.mismatch) passes this (0 = never)."
    )


def _groups(batch: Sequence[Any]) -> list[list[int]]:
    """Indices of trajectories sharing a prompt (token ids), in first-seen order."""
    index: dict[bytes, list[int]] = {}
    for i, t in enumerate(batch):
        tok = t.tokens
        index.setdefault(np.asarray(tok.token_ids[: tok.prompt_length]).tobytes(), []).append(i)
    return list(index.values())


class BackpropModule:
    """Policy (+ optional value head) updates; ``state_dict`` holds everything a checkpoint needs."""

    def __init__(self, model: Any, config: BackpropConfig | None = None, *, value_head: bool = False) -> None:
        import torch

        self.model = model
        self.config = c = config or BackpropConfig()
        self.opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.ref: Any = None
        if c.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.value_head: Any = None
        self.value_opt: Any = None
        if value_head:
            self.value_head = torch.nn.Linear(int(model.config.hidden_size), 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self.value_opt = torch.optim.Adam(self.value_head.parameters(), lr=c.value_lr)
        self.updates = 0

    # -- per-token views -------------------------------------------------------------------------

    def masks(self, batch: Sequence[Any], trainer_version: int) -> list[npt.NDArray[np.bool_]]:
        """Trained completion tokens per trajectory (positions from ``prompt_length``)."""
        out = []
        for t in batch:
            tok, p = t.tokens, t.tokens.prompt_length
            m = loss_mask(tok) & version_mask(tok, trainer_version, self.config.max_async_level)
            out.append(m[p:])
        return out

    def _forward(self, batch: Sequence[Any], idx: list[int], hidden: bool) -> GroupForward:
        tok = batch[idx[0]].tokens
        prompt = tok.token_ids[: tok.prompt_length]
        comps = [batch[i].tokens.token_ids[batch[i].tokens.prompt_length :] for i in idx]
        forward = invariant_group_forward if self.config.batch_invariant else group_forward
        return forward(self.model, prompt, comps, with_hidden=hidden, temperature=self.config.temperature)

    def values(self, batch: Sequence[Any]) -> list[FloatArray]:
        """Value estimates per completion token (value head on the policy's last hidden state)."""
        import torch

        if self.value_head is None:
            raise ValueError("values need a value head: BackpropModule(model, value_head=True)")
        out: list[FloatArray] = [np.zeros(0)] * len(batch)
        with torch.no_grad():
            for idx in _groups(batch):
                fwd = self._forward(batch, idx, hidden=True)
                assert fwd.hidden is not None
                v = self.value_head(fwd.hidden).squeeze(-1).double().numpy()
                for row, i in enumerate(idx):
                    out[i] = v[row, : len(batch[i].tokens) - batch[i].tokens.prompt_length]
        return out

    def gae(
        self, batch: Sequence[Any], rewards: Sequence[float], values: Sequence[FloatArray], masks: Sequence[Any]
    ) -> tuple[list[FloatArray], list[FloatArray]]:
        """Token advantages and returns: GAE over each trajectory's trained tokens, reward on the last one."""
        advs, rets = [], []
        for r, v, m in zip(rewards, values, masks, strict=True):
            a_tok, r_tok = np.zeros(len(m)), np.zeros(len(m))
            idx = np.flatnonzero(m)
            if idx.size:
                step_r = np.zeros(idx.size)
                step_r[-1] = r
                a, ret = adv.gae(step_r, v[idx], gamma=self.config.gamma, lam=self.config.lam)
                a_tok[idx], r_tok[idx] = a, ret
            advs.append(a_tok)
            rets.append(r_tok)
        return advs, rets

    # -- the update ------------------------------------------------------------------------------

    def update(
        self,
        batch: Sequence[Any],
        advantages: Sequence[FloatArray],
        *,
        trainer_version: int = 0,
        returns: Sequence[FloatArray] | None = None,
        old_values: Sequence[FloatArray] | None = None,
    ) -> dict[str, float]:
        """One optimizer step; ``advantages`` per completion token (``len(traj) - prompt_length`` each)."""
        import torch

        masks = self.masks(batch, trainer_version)
        advs = [np.where(m, a, 0.0) for a, m in zip(advantages, masks, strict=True)]
        if self.config.normalize_advantages:
            advs = normalize(advs, masks)
        stats = {"loss": 0.0, "clip_frac": 0.0, "ratio": 0.0, "kl": 0.0, "value_loss": 0.0}
        stats["trained_tokens"] = float(sum(int(m.sum()) for m in masks))
        self.opt.zero_grad(set_to_none=True)
        if self.value_opt is not None:
            self.value_opt.zero_grad(set_to_none=True)
        n = len(batch)
        monitor = MismatchMonitor()
        for idx in _groups(batch):
            w = len(idx) / n
            group_stats = self._group_loss(batch, idx, advs, masks, returns, old_values, w, monitor, trainer_version)
            for k, v in group_stats.items():
                stats[k] = stats.get(k, 0.0) + v * w
        stats |= monitor.figures()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        stats["grad_norm"] = float(norm)
        if not torch.isfinite(norm):  # never step into non-finite weights
            self.opt.zero_grad(set_to_none=True)
            stats["skipped"] = 1.0
            return stats
        self.opt.step()
        if self.value_opt is not None:
            self.value_opt.step()
        self.updates += 1
        self.update_reference()
        return stats

    def _group_loss(
        self,
        batch: Sequence[Any],
        idx: list[int],
        advs: Sequence[FloatArray],
        masks: Sequence[Any],
        returns: Sequence[FloatArray] | None,
        old_values: Sequence[FloatArray] | None,
        weight: float,
        monitor: MismatchMonitor | None = None,
        trainer_version: int = 0,
    ) -> dict[str, float]:
        import torch

        c = self.config
        with_values = self.value_head is not None and returns is not None and old_values is not None
        fwd = self._forward(batch, idx, hidden=with_values)
        p = [batch[i].tokens.prompt_length for i in idx]
        mask = pad_right([masks[i] for i in idx], 0, torch.bool) & fwd.mask
        old = [
            np.nan_to_num(batch[i].tokens.logprobs[q:], nan=0.0, posinf=0.0, neginf=0.0)
            for i, q in zip(idx, p, strict=True)
        ]
        old_lp = pad_right(old, 0.0, fwd.logprobs.dtype)  # float64 in batch_invariant mode: the engine's exact bits
        weights = None
        if c.correction != "none":  # the mismatch goes into a weight; the ratio is measured from the trainer's own
            kw_w = {"cap": c.tis_cap, "low": c.mis_low, "high": c.mis_high}
            weights = mismatch_weights(fwd.logprobs, old_lp, mask, c.correction, **kw_w)
            old_lp = fwd.logprobs.detach()
        if monitor is not None:  # the engine's logprobs against the trainer's, on the tokens trained on
            trainer_lp, trained = fwd.logprobs.detach().double().numpy(), mask.numpy()
            for j, (i, q) in enumerate(zip(idx, p, strict=True)):
                tok, sel = batch[i].tokens, trained[j, : len(batch[i].tokens) - q]
                monitor.add(
                    trainer_lp[j, : sel.size][sel],
                    np.asarray(tok.logprobs[q:], np.float64)[sel],
                    np.asarray(tok.origins[q:])[sel],
                    np.asarray(tok.policy_versions[q:])[sel],
                    trainer_version,
                )
        adv_t = pad_right([advs[i] for i in idx], 0.0, torch.float32)
        if weights is not None:
            adv_t = adv_t * weights
        if c.loss == "aipo":
            loss, st = token_is_loss(fwd.logprobs, old_lp, adv_t, mask, cap=c.is_cap, mode=c.aggregation)
        elif c.loss == "gspo":
            loss, st = gspo_loss(fwd.logprobs, old_lp, adv_t, mask, clip_low=c.clip_low, clip_high=c.clip_high)
        elif c.loss == "cispo":
            kw_c = {"clip_low": c.clip_low, "clip_high": c.clip_high, "mode": c.aggregation}
            loss, st = cispo_loss(fwd.logprobs, old_lp, adv_t, mask, **kw_c)  # type: ignore[arg-type]
        else:
            kw = {"clip_low": c.clip_low, "clip_high": c.clip_high, "mode": c.aggregation}
            loss, st = clipped_surrogate(fwd.logprobs, old_lp, adv_t, mask, **kw)  # type: ignore[arg-type]
        out = {"loss": float(loss.detach()), "clip_frac": st["clip_frac"], "ratio": st["ratio_mean"]}
        if weights is not None:  # what the correction kept (share of trained tokens with a weight) and their weight
            n_tok = float(mask.sum().clamp(min=1))
            out["correction/kept"] = float((weights > 0).sum()) / n_tok
            out["correction/mean_weight"] = float(weights.sum()) / n_tok
        if self.ref is not None:
            with torch.no_grad():
                prompt = batch[idx[0]].tokens.token_ids[: p[0]]
                comps = [batch[i].tokens.token_ids[q:] for i, q in zip(idx, p, strict=True)]
                forward = invariant_group_forward if c.batch_invariant else group_forward
                ref_lp = forward(self.ref, prompt, comps, temperature=c.temperature).logprobs
            kl = aggregate(kl_k3(fwd.logprobs, ref_lp), mask, "token_mean")
            loss = loss + c.kl_coef * kl
            out["kl"] = float(kl.detach())
        (loss * weight).backward()
        if with_values:
            assert fwd.hidden is not None and returns is not None and old_values is not None
            v = self.value_head(fwd.hidden.detach()).squeeze(-1)
            old_v = pad_right([old_values[i] for i in idx], 0.0, torch.float32)
            ret = pad_right([returns[i] for i in idx], 0.0, torch.float32)
            vl = value_loss(v, old_v, ret, mask, clip=c.value_clip)
            (vl * weight).backward()
            out["value_loss"] = float(vl.detach())
        return out

    def update_reference(self) -> None:
        import torch

        c = self.config
        if self.ref is None or c.ref_update == "none":
            return
        if c.ref_update == "copy":
            if self.updates % c.ref_interval == 0:
                self.ref.load_state_dict(self.model.state_dict())
            return
        with torch.no_grad():
            for r, p in zip(self.ref.parameters(), self.model.parameters(), strict=True):
                r.mul_(c.ref_ema_decay).add_(p.detach(), alpha=1.0 - c.ref_ema_decay)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "updates": self.updates,
        }
        if self.ref is not None:
            state["ref"] = self.ref.state_dict()
        if self.value_head is not None:
            state["value_head"] = self.value_head.state_dict()
            state["value_opt"] = self.value_opt.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.updates = int(state["updates"])
        if self.ref is not None and "ref" in state:
            self.ref.load_state_dict(state["ref"])
        if self.value_head is not None and "value_head" in state:
            self.value_head.load_state_dict(state["value_head"])
            self.value_opt.load_state_dict(state["value_opt"])


def normalize(advantages: Sequence[FloatArray], masks: Sequence[Any]) -> list[FloatArray]:
    """``(a - mean) / (std + 1e-8)`` over every trained token of the batch; untrained tokens stay 0."""
    flat = np.concatenate([a[np.asarray(m, bool)] for a, m in zip(advantages, masks, strict=True)] or [np.zeros(0)])
    if flat.size < 2:
        return list(advantages)
    mean, std = flat.mean(), flat.std()
    return [np.where(m, (a - mean) / (std + 1e-8), 0.0) for a, m in zip(advantages, masks, strict=True)]


__all__ = ["BackpropConfig", "BackpropModule", "normalize"]
