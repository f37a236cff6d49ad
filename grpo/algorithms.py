"""``PPOAlgorithm``, ``GRPOAlgorithm``, ``REINFORCEAlgorithm``: one training loop, three advantage estimators.

A step: collect the batch of that step (``RolloutManager``), reward it (``RewardComputer``, ``method`` from the
config), turn rewards into token advantages (the only thing the algorithms differ in), take one
``BackpropModule`` update, push the weights to the bridge (``UpdateWeights``: the new policy version).
Collection runs ahead of training by at most ``max_async_level`` versions (``grpo.pipeline``; 0 = the
synchronous loop); the trainer masks tokens older than that (``BackpropConfig.max_async_level``).

* GRPO: the group baseline of ``estimator`` (GRPO, Dr. GRPO, RLOO; ``grpo.advantages``) on every token;
* REINFORCE: ``reward - b`` with ``b`` a moving average of batch mean rewards (``baseline_decay``);
* PPO: GAE over the trained tokens with a value head (``BackpropModule(value_head=True)``).

Checkpoints (``ckpt``): every ``interval`` steps, ``<out>/checkpoints/step_N/trainer.pt`` holds the model,
optimizer, reference and value head, every RNG, the step (= the sampler position: step ``N``'s batch is
tasks ``N * num_prompts ...``), the policy version and the algorithm's own state; ``keep_last`` prunes older
ones. Resuming (``resume_step``) loads them and pushes the weights to the bridge under the saved version, so
the resumed steps equal an uninterrupted run's (seeded sampling per turn). Logs: one structured console line
and one JSONL record (``<out>/metrics.jsonl``) per step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from grpo import advantages as adv
from grpo.backprop import BackpropModule, normalize
from grpo.pipeline import Pipeline
from grpo.policy import save_for_bridge
from grpo.rewards import Method, RewardComputer
from grpo.rollout import RolloutManager, Trajectory

log = logging.getLogger("primerl.rl")
FloatArray = np.ndarray[Any, np.dtype[np.float64]]


class CheckpointConfig(BaseModel):
    """prime-rl's ``--ckpt`` section."""

    model_config = ConfigDict(extra="forbid")

    interval: int = Field(0, ge=0, description="Checkpoint every this many steps (0 = at the last step only).")
    keep_last: int = Field(0, ge=0, description="Keep only the newest this many checkpoints (0 = all).")
    resume_step: int | None = Field(None, ge=0, description="Resume from the checkpoint of this step.")
    dir: str = Field("", description="Checkpoint directory (default <out_dir>/checkpoints).")


class AlgorithmConfig(BaseModel):
    """What the training loop does around the backprop module."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, description="Seed of the trainer's RNGs.")
    estimator: adv.Estimator = Field(
        "grpo", description="GRPO group baseline: grpo, dr_grpo, rloo or opo (length-weighted, Hao et al. 2025)."
    )
    reward_method: Method = Field("absolute", description="RewardComputer method: absolute, relative, pareto.")
    baseline_decay: float = Field(0.9, ge=0, le=1, description="REINFORCE: moving-average decay of the baseline.")
    normalize_advantages: bool = Field(False, description="Normalise token advantages over the batch.")
    max_async_level: int = Field(0, ge=0, description="Rollouts run at most this many policy versions ahead.")
    out_dir: str = Field("outputs/rl", description="Run directory: metrics.jsonl, weights/, checkpoints/.")
    ckpt: CheckpointConfig | None = Field(None, description="Checkpointing (--ckpt turns it on with defaults).")


class RLAlgorithm:
    """The shared loop (module docstring); subclasses implement ``advantages``."""

    name: ClassVar[str] = "rl"
    value_head: ClassVar[bool] = False

    def __init__(
        self,
        inference: Any,
        rollout_manager: RolloutManager,
        backprop: BackpropModule,
        config: AlgorithmConfig | None = None,
        reward_computer: RewardComputer | None = None,
    ) -> None:
        import torch

        self.inference = inference  # None in the trainer process (grpo.trainer): the orchestrator talks to the bridge
        self.rollouts = rollout_manager
        self.backprop = backprop
        self.config = c = config or AlgorithmConfig()
        self.rewards = reward_computer or RewardComputer()
        if self.value_head and backprop.value_head is None:
            raise ValueError(f"{type(self).__name__} needs BackpropModule(model, value_head=True)")
        self.out = Path(c.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = Path(c.ckpt.dir) if c.ckpt and c.ckpt.dir else self.out / "checkpoints"
        self.step = 0  # completed steps = the next batch's index
        self.version = int(inference.policy_version) if inference is not None else 0
        self.history: list[dict[str, float]] = []
        self.extra_state: dict[str, Any] = {}
        torch.manual_seed(c.seed)
        np.random.seed(c.seed)
        random.seed(c.seed)
        if c.ckpt is not None and c.ckpt.resume_step is not None:
            self.load_checkpoint(c.ckpt.resume_step)

    # -- advantages (the algorithms) -------------------------------------------------------------

    def advantages(self, batch: Sequence[Trajectory], rewards: FloatArray) -> tuple[list[FloatArray], dict[str, Any]]:
        raise NotImplementedError

    @staticmethod
    def per_token(batch: Sequence[Trajectory], values: Sequence[float]) -> list[FloatArray]:
        return [np.full(len(t.tokens) - t.tokens.prompt_length, float(v)) for t, v in zip(batch, values, strict=True)]

    # -- one step --------------------------------------------------------------------------------

    def learn(self, batch: Sequence[Trajectory], save_weights: bool = True) -> dict[str, float]:
        """Rewards, advantages and one update from ``batch`` (blocking; the loop runs it off the event loop); the
        new weights go to ``<out>/weights`` (``save_weights=False``: the trainer process writes one directory per
        step itself)."""
        t0 = time.perf_counter()
        rewards = self.rewards.compute_rewards(batch, self.config.reward_method)
        advs, extra = self.advantages(batch, rewards)
        if self.config.normalize_advantages:
            advs = normalize(advs, self.backprop.masks(batch, self.version))
        stats = self.backprop.update(batch, advs, trainer_version=self.version, **extra)
        kl, limit = stats.get("mismatch/k3_kl", float("nan")), self.backprop.config.mismatch_warn_kl
        if limit and kl > limit:  # NaN (nothing on-policy) compares False
            log.warning(
                "step %d: trainer-inference k3 KL %.3g > mismatch_warn_kl %.3g (max |d logprob| %.3g over %d tokens): "
                "the engine did not sample from the distribution the trainer computes",
                self.step + 1, kl, limit, stats["mismatch/abs_max"], int(stats["mismatch/tokens"]),
            )  # fmt: skip
        if save_weights:
            save_for_bridge(self.backprop.model, self.out / "weights")
        stats["reward"] = float(np.mean([t.reward for t in batch]))
        stats["reward_used"] = float(np.mean(rewards))
        stats["train_s"] = time.perf_counter() - t0
        return stats

    async def _train_step(self, step: int, batch: list[Trajectory]) -> int:
        stats = await asyncio.to_thread(self.learn, batch)
        client = self.inference.client.aio
        self.version = await client.update_weights(str((self.out / "weights").resolve()))
        self.step = step + 1
        row = {"step": self.step, **stats, "policy_version": self.version, **self.rollouts.last_stats.row(batch)}
        self.record(row)
        ck = self.config.ckpt
        if ck is not None and ck.interval and self.step % ck.interval == 0:
            await asyncio.to_thread(self.save_checkpoint)
        if self._bar is not None:
            self._bar.update(1)
        return self.version

    def record(self, row: dict[str, float]) -> None:
        self.history.append(row)
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"algorithm": self.name, **row}) + "\n")
        keys = (
            "reward",
            "loss",
            "clip_frac",
            "kl",
            "value_loss",
            "policy_version",
            "off_policy_gap",
            "rollout_s",
            "train_s",
            "mismatch/k3_kl",
        )
        line = " ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys if k in row)
        log.info("%s step=%d %s", self.name, row["step"], line)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{row['reward']:.3f}", loss=f"{row['loss']:.4f}")

    _bar: Any = None

    def train(
        self, num_iterations: int, progress_bar: bool = True, time_budget_s: float | None = None
    ) -> list[dict[str, float]]:
        """Run until ``num_iterations`` steps are done (counting those before a resume); returns the new rows.

        ``time_budget_s``: start no step that would end after it (at the mean step time so far).
        """
        first = self.step
        if first >= num_iterations:
            return []
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=num_iterations, initial=first, desc=f"{self.name} steps", unit="step")
        pipeline: Pipeline[list[Trajectory]] = Pipeline(self.config.max_async_level, self.version)
        t0 = time.perf_counter()

        async def collect(step: int) -> list[Trajectory]:
            elapsed, done = time.perf_counter() - t0, step - first
            if time_budget_s is not None and done and elapsed + elapsed / done > time_budget_s:
                raise _OutOfTime(step)
            return await self.rollouts.acollect(step)

        async def run() -> None:
            try:
                await pipeline.run(first, num_iterations, collect, self._train_step)
            except* _OutOfTime:
                log.info("%s: time budget of %.0f s reached after step %d", self.name, time_budget_s, self.step)

        try:
            self.inference.client.run(run())
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        ck = self.config.ckpt
        if ck is not None and (not ck.interval or self.step % ck.interval):
            self.save_checkpoint()  # the last step, when the interval did not cover it
        return self.history[len(self.history) - (self.step - first) :]

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        import torch

        d = self.ckpt_dir / f"step_{self.step}"
        tmp = d.with_name(d.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "policy_version": self.version,
            "backprop": self.backprop.state_dict(),
            "algorithm": self.extra_state,
            "history": self.history,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }
        torch.save(state, tmp / "trainer.pt")
        if d.exists():
            shutil.rmtree(d)
        tmp.replace(d)
        keep = self.config.ckpt.keep_last if self.config.ckpt else 0
        if keep:
            steps = sorted(int(p.name[5:]) for p in self.ckpt_dir.glob("step_*") if p.name[5:].isdigit())
            for s in steps[:-keep]:
                shutil.rmtree(self.ckpt_dir / f"step_{s}", ignore_errors=True)
        return d

    def load_checkpoint(self, step: int) -> None:
        version = self.restore_checkpoint(step)
        save_for_bridge(self.backprop.model, self.out / "weights")
        if version != self.version:  # a fresh bridge: give it the checkpoint's weights under their version
            self.version = self.inference.client.update_weights(
                str((self.out / "weights").resolve()), policy_version=version
            )

    def restore_checkpoint(self, step: int) -> int:
        """Load the checkpoint of ``step`` (model, optimizer, RNGs, algorithm state); returns its policy version."""
        import torch

        path = self.ckpt_dir / f"step_{step}" / "trainer.pt"
        if not path.is_file():
            have = sorted(p.name for p in self.ckpt_dir.glob("step_*"))
            raise FileNotFoundError(f"no checkpoint for step {step} at {path}; checkpoints: {have or 'none'}")
        state = torch.load(path, weights_only=False)
        self.backprop.load_state_dict(state["backprop"])
        self.step = int(state["step"])
        self.extra_state = dict(state["algorithm"])
        self.history = list(state["history"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        return int(state["policy_version"])


class _OutOfTime(Exception):
    pass


class GRPOAlgorithm(RLAlgorithm):
    """Group-relative advantages (``estimator``: grpo, dr_grpo, rloo, opo) on every token of a member."""

    name = "grpo"

    def advantages(self, batch: Sequence[Trajectory], rewards: FloatArray) -> tuple[list[FloatArray], dict[str, Any]]:
        lengths = None
        if self.config.estimator == "opo":  # OPO's weights: each member's trained tokens
            lengths = [int(m.sum()) for m in self.backprop.masks(batch, self.version)]
        a = adv.group_advantages(rewards, [t.group for t in batch], self.config.estimator, lengths)
        return self.per_token(batch, a.tolist()), {}


class REINFORCEAlgorithm(RLAlgorithm):
    """``reward - b``, ``b`` the moving average of batch mean rewards (initialised by the first batch)."""

    name = "reinforce"

    def advantages(self, batch: Sequence[Trajectory], rewards: FloatArray) -> tuple[list[FloatArray], dict[str, Any]]:
        mean = float(np.mean(rewards))
        b = float(self.extra_state.get("baseline", mean))
        out = self.per_token(batch, (rewards - b).tolist())
        decay = self.config.baseline_decay
        self.extra_state["baseline"] = decay * b + (1.0 - decay) * mean
        return out, {}


class PPOAlgorithm(RLAlgorithm):
    """GAE over the trained tokens with the value head's estimates; the clipped value loss fits the head."""

    name = "ppo"
    value_head = True

    def advantages(self, batch: Sequence[Trajectory], rewards: FloatArray) -> tuple[list[FloatArray], dict[str, Any]]:
        values = self.backprop.values(batch)
        masks = self.backprop.masks(batch, self.version)
        advs, returns = self.backprop.gae(batch, rewards.tolist(), values, masks)
        return advs, {"returns": returns, "old_values": values}


__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "GRPOAlgorithm",
    "PPOAlgorithm",
    "REINFORCEAlgorithm",
    "RLAlgorithm",
]
