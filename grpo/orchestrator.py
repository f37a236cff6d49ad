"""``primerl orchestrator``: the orchestrator process of the three-component loop (prime-rl's orchestrator).

A light process against a running bridge (``bridge.target``): for batch ``S`` it has the bridge serve policy
``max(0, S - k)`` (``k`` = ``max_async_level``; it waits for the trainer's ``weights/step_N`` and loads it with
``UpdateWeights`` under version ``N``), collects the batch (``RolloutManager``: groups through the Env Hub's
environment, rewards graded), and writes it for the trainer (``grpo.exchange``). While the trainer trains on batch
``S - 1`` it is already sampling batch ``S`` (for ``k >= 1``). With ``eval.problems > 0`` it grades the held-out
problems greedily on policy 0 before the run and on the last policy after it (``<out_dir>/eval.json``).

Per batch it appends one record to ``<out_dir>/orchestrator.jsonl`` (policy, weights directory, whether it loaded
it, rollout timestamps, reward). Checkpoints (``--ckpt``): ``checkpoints/orchestrator/step_N/progress.json`` (the next
batch, tokens, samples, problems so far); ``--ckpt.resume-step N`` continues with batch ``N``, the bridge given
policy ``max(0, N - k)`` from the trainer's checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from grpo.algorithms import CheckpointConfig
from grpo.exchange import Batch, ExchangeError, RunDir, sampling_policy, wait_for
from grpo.rollout import RolloutConfig, RolloutManager
from grpo.run_config import EvalSection, TaskSection, evaluate_policy, task_environment

log = logging.getLogger("primerl.orchestrator")


class TargetSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field("", description="host:port of the bridge (primerl inference) the rollouts run on.")


class OrchestratorConfig(BaseModel):
    """``primerl orchestrator``."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(10, ge=1, description="Batches to have produced (a resumed run counts those before it).")
    max_async_level: int = Field(2, ge=0, description="Batch S is sampled from policy max(0, S - k).")
    out_dir: str = Field("outputs/rl", description="Run directory shared with the trainer.")
    ckpt: CheckpointConfig | None = Field(None, description="Checkpointing (--ckpt turns it on with defaults).")
    weights_timeout_s: float = Field(
        1800.0, ge=0, description="Give up waiting for the trainer's weights after this long (0 = wait forever)."
    )
    log_level: str = Field("INFO", description="Console log level.")
    bridge: TargetSection = Field(default_factory=TargetSection)
    task: TaskSection = Field(default_factory=TaskSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


class Orchestrator:
    """The loop of ``primerl orchestrator`` (module docstring)."""

    def __init__(self, cfg: OrchestratorConfig) -> None:
        from grpo.inference import InferenceModule

        self.cfg = cfg
        ck = cfg.ckpt
        self.run = RunDir(cfg.out_dir, ck.dir if ck else "")
        self.resume = ck.resume_step if ck is not None else None
        self.progress: dict[str, Any] = {"step": 0, "tokens": 0, "samples": 0, "problems": 0}
        if self.resume is not None:
            self.progress = self.run.read_progress(self.resume)
        if not cfg.bridge.target:
            raise ExchangeError("bridge.target: set host:port of a running bridge (primerl inference)")
        self.inference = InferenceModule(cfg.bridge.target)
        self.manager = RolloutManager(self.inference, task_environment(cfg.task), cfg.rollout)
        self.serving: tuple[int, str] | None = None
        self.fresh_bridge = self.inference.policy_version == 0
        self.run.root.mkdir(parents=True, exist_ok=True)

    def weights_dir(self, policy: int) -> Path | None:
        return self.run.policy_weights(policy, self.resume, self.cfg.max_async_level)

    def serve(self, policy: int) -> tuple[str, bool]:
        """Have the bridge serve ``policy``; returns its weights id and whether the bridge loaded it now."""
        what = f"the trainer's weights of policy {policy} ({self.run.weights(policy)})"
        wait_for(lambda: self.weights_dir(policy) is not None, what, self.cfg.weights_timeout_s)
        d = self.weights_dir(policy)
        assert d is not None
        wid = self.run.weights_id(d)
        if self.serving == (policy, wid):
            return wid, False
        if policy == 0 and self.serving is None and self.fresh_bridge:
            self.serving = (0, wid)  # a fresh bridge serves the base model, which is policy 0
            return wid, False
        if policy == 0:
            raise ExchangeError("the bridge serves another policy than the base model: start a fresh bridge")
        client = self.inference.client
        assert client is not None  # InferenceModule(target) always has one
        version = client.update_weights(str(d.resolve()), policy_version=policy)
        if version != policy:
            raise ExchangeError(f"the bridge loaded {d} as policy version {version}, not {policy}")
        log.info("bridge serves policy %d (%s)", policy, d)
        self.serving = (policy, wid)
        return wid, True

    def evaluate(self, policy: int) -> dict[str, float]:
        self.serve(policy)
        train_set = {p.question for p in self.manager.environment.prompts}
        result = evaluate_policy(self.inference, self.cfg.task, self.cfg.eval, self.cfg.rollout, train_set)
        log.info("held-out on policy %d: %s", policy, result)
        return result | {"policy": float(policy)}

    def run_batches(self) -> None:
        cfg, k = self.cfg, self.cfg.max_async_level
        report: dict[str, Any] = {}
        first = int(self.progress["step"])
        if cfg.eval.problems and first == 0:
            report["before"] = self.evaluate(0)
        for step in range(first, cfg.max_steps):
            policy = sampling_policy(step, k)
            wid, loaded = self.serve(policy)
            t0 = time.time()
            trajectories = self.manager.collect(step)
            t1 = time.time()
            stats = self.manager.last_stats.row(trajectories)
            self.run.write_batch(Batch(step, policy, wid, trajectories, stats, t0, t1))
            p = self.progress
            p["step"] = step + 1
            p["tokens"] += int(sum(len(t.tokens) for t in trajectories))
            p["samples"] += len(trajectories)
            p["problems"] += cfg.rollout.num_prompts
            reward = float(np.mean([t.reward for t in trajectories]))
            record = {"step": step, "policy": policy, "weights": str(self.weights_dir(policy)), "loaded": loaded}
            record |= {"rollout_start": t0, "rollout_end": t1, "reward": reward}
            record |= {"tokens": p["tokens"], "samples": p["samples"], "problems": p["problems"]}
            with (self.run.root / "orchestrator.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            log.info("batch %d from policy %d: reward %.3f, %.1f s", step, policy, reward, t1 - t0)
            ck = cfg.ckpt
            if ck is not None and ((ck.interval and (step + 1) % ck.interval == 0) or step + 1 == cfg.max_steps):
                self.run.write_progress(step + 1, dict(p))
        if cfg.eval.problems:
            report["after"] = self.evaluate(cfg.max_steps)
            path = self.run.root / "eval.json"
            if "before" not in report and path.is_file():  # a resumed run: the first run's "before" stays
                report = {"before": json.loads(path.read_text()).get("before")} | report
            path.write_text(json.dumps(report, indent=1))

    def close(self) -> None:
        self.inference.close()


def run_orchestrator(cfg: OrchestratorConfig) -> int:
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    orch = Orchestrator(cfg)
    try:
        orch.run_batches()
    finally:
        orch.close()
    return 0


__all__ = ["Orchestrator", "OrchestratorConfig", "run_orchestrator"]
