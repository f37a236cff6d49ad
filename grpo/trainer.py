"""``primerl trainer``: the trainer process of the three-component loop (prime-rl's trainer).

It reads the orchestrator's batch ``S`` (``grpo.exchange``), checks where its tokens were sampled (batch ``S``
must come from policy ``max(0, S - k)``: a batch newer than the trainer's policy or more than ``k`` =
``max_async_level`` versions older is refused, naming the step), turns it into one update with the configured
algorithm and objective (``grpo.algorithms``: GRPO/RLOO/Dr.GRPO/OPO advantages, PPO, REINFORCE; ``trainer.loss``:
clip, AIPO, GSPO, CISPO) and writes policy ``S + 1`` to ``weights/step_{S+1}``. One JSONL record and one log line
per step (``<out_dir>/metrics.jsonl``) carry the batch's reward, the update's figures and the off-policy gap
(``S`` minus the policy the batch was sampled from). It never talks to the bridge.

Checkpoints (``--ckpt``): ``checkpoints/trainer/step_N`` holds the model, optimizer, RNGs and algorithm state
(``RLAlgorithm.save_checkpoint``) and hard links to ``weights/step_{N-k} .. step_N`` (what the orchestrator loads
to resume); ``--ckpt.resume-step N`` restores them and continues with batch ``N``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from grpo.algorithms import AlgorithmConfig
from grpo.backprop import BackpropConfig
from grpo.exchange import Batch, ExchangeError, RunDir, sampling_policy

log = logging.getLogger("primerl.trainer")


class TrainerConfig(AlgorithmConfig, BackpropConfig):
    """``primerl trainer``: the loop's keys (``AlgorithmConfig``) and the update's (``BackpropConfig``: learning
    rate, objective, clipping) at one level, so ``primerl rl --trainer.lr 1e-5 --trainer.loss gspo`` reads as
    it does in prime-rl."""

    algorithm: Literal["grpo", "ppo", "reinforce"] = Field("grpo", description="The training algorithm.")
    max_steps: int = Field(10, ge=1, description="Steps to have run (a resumed run counts the steps before it).")
    max_async_level: int = Field(
        2, ge=0, description="Batch S is sampled from policy max(0, S - k); older or newer batches are refused."
    )
    model: str = Field("", description="Model directory (default: the bridge's default model).")
    batch_timeout_s: float = Field(
        1800.0, ge=0, description="Give up waiting for a rollout batch after this long (0 = wait forever)."
    )
    log_level: str = Field("INFO", description="Console log level.")


class Offline:
    """The trainer's stand-in for ``InferenceModule``: the policy version is the trainer's own step."""

    client = None

    def __init__(self, version: int) -> None:
        self.policy_version = version


def refuse_future(batch: Batch, step: int) -> None:
    """``ExchangeError`` when ``batch`` was sampled from a policy the trainer has not made yet."""
    newest = max(batch.token_versions()[1], batch.policy)
    if newest > step:
        raise ExchangeError(
            f"the batch of step {step} was sampled from policy {newest}, newer than the trainer's policy {step}: "
            "a batch from the future (is another run writing to this out_dir?)"
        )


def check_batch(batch: Batch, step: int, max_async_level: int) -> int:
    """The off-policy gap of ``batch`` for training step ``step``; ``ExchangeError`` for a batch from the future
    or older than ``max_async_level``."""
    refuse_future(batch, step)
    oldest = batch.token_versions()[0]
    if step - oldest > max_async_level:
        raise ExchangeError(
            f"the batch of step {step} was sampled from policy {oldest}, {step - oldest} versions old: more than "
            f"max_async_level = {max_async_level} (expected policy {sampling_policy(step, max_async_level)})"
        )
    return step - oldest


def build(cfg: TrainerConfig) -> Any:
    """The algorithm (model, backprop module) without a bridge."""
    import grpo
    from engines.model_store import load_model_and_tokenizer, resolve_model_dir

    model_dir = Path(cfg.model) if cfg.model else resolve_model_dir(None)
    if cfg.model and not model_dir.is_dir():
        raise ExchangeError(f"model: no model directory at {model_dir}")
    model, _ = load_model_and_tokenizer(model_dir)
    model.train()
    backprop_cfg = BackpropConfig.model_validate(cfg.model_dump(include=set(BackpropConfig.model_fields)))
    backprop = grpo.BackpropModule(model, backprop_cfg, value_head=cfg.algorithm == "ppo")
    cls = {"grpo": grpo.GRPOAlgorithm, "ppo": grpo.PPOAlgorithm, "reinforce": grpo.REINFORCEAlgorithm}[cfg.algorithm]
    algo_cfg = AlgorithmConfig.model_validate(cfg.model_dump(include=set(AlgorithmConfig.model_fields)))
    if cfg.ckpt is not None:  # restored by run_trainer (the algorithm would push the weights to a bridge)
        algo_cfg = algo_cfg.model_copy(update={"ckpt": cfg.ckpt.model_copy(update={"resume_step": None})})
    return cls(Offline(0), None, backprop, algo_cfg)


def next_batch(run: RunDir, step: int, known: dict[int, set[str]], timeout_s: float) -> Batch:
    """Batch ``step``, once one sampled from weights this trainer wrote or restored is on disk (an earlier run's
    batch of that step is left for the orchestrator to replace); a batch from the future is refused at once."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    path, stale = run.batch_path(step), False
    while True:
        if path.exists():
            batch = run.read_batch(step)
            refuse_future(batch, step)
            if batch.weights_id in known.get(batch.policy, set()):
                return batch
            if not stale:
                log.info("the batch of step %d on disk was sampled from other weights (an earlier run): waiting", step)
                stale = True
        if deadline is not None and time.monotonic() > deadline:
            why = " (the one there was sampled from weights this trainer did not write)" if stale else ""
            raise ExchangeError(
                f"waited {timeout_s:.0f} s for the rollout batch of step {step} at {path}{why}: "
                "is the orchestrator running on this out_dir?"
            )
        time.sleep(0.2)


def run_trainer(cfg: TrainerConfig) -> int:
    from grpo.policy import save_for_bridge

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ck = cfg.ckpt
    run = RunDir(cfg.out_dir, ck.dir if ck else "")
    k = cfg.max_async_level
    known: dict[int, set[str]] = {}  # policy -> ids of its weights directories this trainer wrote or restored
    if ck is not None and ck.resume_step is not None:
        d = run.trainer_ckpt(ck.resume_step)
        if not (d / "trainer.pt").is_file():
            have = sorted(p.name for p in d.parent.glob("step_*")) if d.parent.is_dir() else []
            raise ExchangeError(f"ckpt.resume_step: no trainer checkpoint at {d}; checkpoints: {have or 'none'}")
        for w in sorted((d / "weights").glob("step_*")):
            known.setdefault(int(w.name[5:]), set()).add(run.weights_id(w))
    algo = build(cfg)
    algo.ckpt_dir = run.ckpt / "trainer"
    if ck is not None and ck.resume_step is not None:
        algo.version = algo.restore_checkpoint(ck.resume_step)
        algo.step = ck.resume_step
        log.info("resumed from %s (policy %d)", run.trainer_ckpt(algo.step), algo.version)
    # the current policy, for the orchestrator (step_0 = the base model), unless the checkpoint's link is there
    save = lambda d: save_for_bridge(algo.backprop.model, d)  # noqa: E731
    here = run.weights(algo.step)
    if not (here.is_dir() and (here / "weights_id").is_file() and run.weights_id(here) in known.get(algo.step, ())):
        known.setdefault(algo.step, set()).add(run.write_weights(algo.step, save))
    for step in range(algo.step, cfg.max_steps):
        t_wait = time.time()
        batch = next_batch(run, step, known, cfg.batch_timeout_s)
        gap = check_batch(batch, step, k)
        t_train = time.time()
        stats = algo.learn(batch.trajectories, save_weights=False)
        algo.step = algo.version = step + 1
        known.setdefault(algo.step, set()).add(run.write_weights(algo.step, save))
        row: dict[str, Any] = {"step": algo.step, **stats, "policy_version": algo.version}
        row |= {"batch_policy": batch.policy, "off_policy_gap": gap} | batch.stats
        row |= {"rollout_start": batch.started_at, "rollout_end": batch.ended_at}
        row |= {"train_start": t_train, "train_end": time.time(), "wait_s": t_train - t_wait}
        algo.record(row)
        if ck is not None and ((ck.interval and algo.step % ck.interval == 0) or algo.step == cfg.max_steps):
            run.link_weights_into(algo.save_checkpoint(), range(sampling_policy(algo.step, k), algo.step + 1))
        run.prune_weights(sampling_policy(algo.step, k))  # the orchestrator needs policy max(0, S - k) from here on
    return 0


__all__ = ["TrainerConfig", "build", "check_batch", "next_batch", "refuse_future", "run_trainer"]
