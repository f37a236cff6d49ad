"""``primerl rl``: single-node RL (a bridge child on the embedded engine, the orchestrator and the trainer).

Configuration is prime-rl's layering (``core.layered_config``): ``primerl rl @ examples/grpo.toml
--max-steps 6 --ckpt --ckpt.interval 3``, ``PRIMERL_MAX_STEPS=6``, ``--dry-run`` prints the resolved TOML.
Given one config (``@ examples/grpo.toml``), the orchestrator (``RolloutManager`` over the bridge) and the
trainer (``BackpropModule``) run in this process, the bridge as a child (``bridge.target`` names a running one
instead). Given a config per component (``primerl rl --trainer @ t.toml --orchestrator @ o.toml --inference @
i.toml``), ``grpo.launcher`` runs them as three processes, as prime-rl does: ``primerl inference`` (the bridge),
``primerl orchestrator`` (``grpo.orchestrator``) and ``primerl trainer`` (``grpo.trainer``), asynchronous by
``max_async_level`` steps.

A run writes ``<out_dir>/metrics.jsonl`` (one record per step), ``<out_dir>/weights/``, checkpoints under
``<out_dir>/checkpoints/step_N`` (``--ckpt``) and, with ``eval.problems > 0``, a held-out evaluation
before and after training (greedy, the task's exact-answer rate) in ``<out_dir>/eval.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from grpo.algorithms import AlgorithmConfig
from grpo.backprop import BackpropConfig
from grpo.commands import COMMANDS
from grpo.plots import plot
from grpo.rollout import RolloutConfig
from grpo.run_config import BridgeSection, EvalSection, TaskSection, evaluate_policy, task_environment

log = logging.getLogger("primerl.rl")


class RLConfig(AlgorithmConfig):
    """``primerl rl`` (and ``trainer`` / ``orchestrator``)."""

    algorithm: Literal["grpo", "ppo", "reinforce"] = Field("grpo", description="The training algorithm.")
    max_steps: int = Field(30, ge=1, description="Steps to have run (a resumed run counts the steps before it).")
    max_minutes: float = Field(0.0, ge=0, description="Start no step that would end after this (0 = no limit).")
    bench: bool = Field(False, description="Print per-step timing figures at the end and write bench.json.")
    model: str = Field("", description="Trainer model directory (default: the bridge's default model).")
    log_level: str = Field("INFO", description="Console log level.")
    bridge: BridgeSection = Field(default_factory=BridgeSection)
    task: TaskSection = Field(default_factory=TaskSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: BackpropConfig = Field(default_factory=BackpropConfig)


@contextmanager
def _bridge(cfg: RLConfig) -> Iterator[str]:
    if cfg.bridge.target:
        yield cfg.bridge.target
        return
    from grpo.bridge_proc import bridge_process

    with bridge_process(cfg.bridge.engine, cfg.bridge.args) as target:
        yield target


def build(cfg: RLConfig, target: str) -> Any:
    """The algorithm for ``cfg`` against the bridge at ``target`` (model, environment, modules)."""
    import grpo
    from engines.model_store import load_model_and_tokenizer, resolve_model_dir

    env = task_environment(cfg.task)
    inference = grpo.InferenceModule(target)
    rollouts = grpo.RolloutManager(inference, env, cfg.rollout)
    model, _ = load_model_and_tokenizer(Path(cfg.model) if cfg.model else resolve_model_dir(None))
    model.train()
    trainer_cfg = cfg.trainer.model_copy(update={"max_async_level": cfg.max_async_level})
    backprop = grpo.BackpropModule(model, trainer_cfg, value_head=cfg.algorithm == "ppo")
    cls = {"grpo": grpo.GRPOAlgorithm, "ppo": grpo.PPOAlgorithm, "reinforce": grpo.REINFORCEAlgorithm}[cfg.algorithm]
    algo_cfg = AlgorithmConfig.model_validate(cfg.model_dump(include=set(AlgorithmConfig.model_fields)))
    return cls(inference, rollouts, backprop, algo_cfg)


def evaluate(algo: Any, cfg: RLConfig) -> dict[str, float]:
    """Greedy exact-answer rate and mean reward on ``eval.problems`` held-out problems."""
    train_set = {p.question for p in algo.rollouts.environment.prompts}
    return evaluate_policy(algo.inference, cfg.task, cfg.eval, cfg.rollout, train_set)


def run_rl(cfg: RLConfig) -> int:
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    with _bridge(cfg) as target:
        algo = build(cfg, target)
        try:
            report: dict[str, Any] = {}
            if cfg.eval.problems and algo.step == 0:
                report["before"] = evaluate(algo, cfg)
                log.info("held-out before training: %s", report["before"])
            budget = cfg.max_minutes * 60 - (time.perf_counter() - t0) if cfg.max_minutes else None
            algo.train(cfg.max_steps, progress_bar=True, time_budget_s=budget)
            if cfg.eval.problems:
                report["after"] = evaluate(algo, cfg)
                log.info("held-out after training: %s", report["after"])
                (algo.out / "eval.json").write_text(json.dumps(report, indent=1))
        finally:
            algo.inference.close()
    if algo.history:
        plot(algo.history, algo.out / "reward_curve.png", f"SmolLM2-135M, {cfg.algorithm} through the bridge")
        log.info("reward curve: %s", algo.out / "reward_curve.png")
    if cfg.bench:
        _bench_summary(algo, time.perf_counter() - t0)
    return 0


def _bench_summary(algo: Any, wall_s: float) -> None:
    """``--bench``: timing figures to ``<out_dir>/bench.json`` (with the per-step rows) and stdout; ``bench/rl.py``
    (``make run``) records them in ``bench/RESULTS.md``."""
    rows = algo.history
    mean = lambda k, rs=rows: sum(r.get(k, 0.0) for r in rs) / max(1, len(rs))  # noqa: E731
    k = max(1, min(5, len(rows) // 2))
    figures = {
        "steps": len(rows),
        "rollout_s_mean": mean("rollout_s"),
        "train_s_mean": mean("train_s"),
        "tokens_per_s_mean": mean("tokens_per_s"),
        "reward_first": mean("reward", rows[:k]),
        "reward_last": mean("reward", rows[-k:]),
        "wall_s": wall_s,
    }
    (algo.out / "bench.json").write_text(json.dumps(figures | {"per_step": rows}, indent=1))
    print(json.dumps(figures))


def run_command(command: str, argv: list[str]) -> int:
    """``primerl rl | trainer | orchestrator`` with layered config; exits 2 on a bad config, 1 on a failed run."""
    import signal

    from core.layered_config import run_cli
    from grpo.exchange import ExchangeError
    from grpo.launcher import is_launch, launch
    from grpo.orchestrator import OrchestratorConfig, run_orchestrator
    from grpo.trainer import TrainerConfig, run_trainer

    if command == "rl" and is_launch(argv):
        return launch(argv)
    entry: dict[str, tuple[type[BaseModel], Callable[[Any], int]]] = {
        "rl": (RLConfig, run_rl),
        "trainer": (TrainerConfig, run_trainer),
        "orchestrator": (OrchestratorConfig, run_orchestrator),
    }
    cls, run = entry[command]
    try:
        cfg = run_cli(cls, argv, prog=f"primerl {command}", description=sys.modules[run.__module__].__doc__)
    except SystemExit as exc:
        return int(exc.code or 0)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: children stopped
    try:
        return run(cfg)
    except ExchangeError as exc:
        print(f"primerl {command}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.cli")
    parser.add_argument("command", choices=COMMANDS)
    args, rest = parser.parse_known_args(argv)
    return run_command(args.command, rest)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BridgeSection",
    "EvalSection",
    "RLConfig",
    "TaskSection",
    "build",
    "evaluate",
    "main",
    "run_command",
    "run_rl",
]
