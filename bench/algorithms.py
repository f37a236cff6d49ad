"""PPO, GRPO and REINFORCE on the calculator task through the bridge (embedded SmolLM2-135M, torch CPU).

For each algorithm, on a fresh bridge child (base weights) with the same seeds: ``--steps`` training steps of
``--group-size`` episodes (``grpo.cli.build``, the config ``primerl rl`` uses). The baseline is measured in the
same run: the batches of the last two steps (same problems, same per-turn sampling seeds) sampled by the
untrained model. Figures: mean reward of the first step, of the last two, the untrained baseline of those
two, the gain over it, and the mean rollout / train time per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import record
from grpo.bridge_proc import bridge_process
from grpo.cli import RLConfig, build


def config(name: str, args: argparse.Namespace, out: Path) -> RLConfig:
    return RLConfig.model_validate(
        {
            "algorithm": name,
            "seed": args.seed,
            "out_dir": str(out / name),
            "normalize_advantages": name != "grpo",
            "rollout": {
                "group_size": args.group_size,
                "temperature": 0.8,
                "turn_max_tokens": [32, 8],
                "max_concurrent": args.group_size,
            },
            "trainer": {"lr": args.lr, "temperature": 0.8},
        }
    )


def untrained(args: argparse.Namespace, out: Path) -> float:
    from grpo import InferenceModule, RolloutManager
    from grpo.tasks import ArithmeticEnvironment

    cfg = config("grpo", args, out)
    with bridge_process() as target:
        inference = InferenceModule(target)
        manager = RolloutManager(inference, ArithmeticEnvironment(), cfg.rollout)
        rewards = [t.reward for s in (args.steps - 2, args.steps - 1) for t in manager.collect(s)]
        inference.close()
    return float(np.mean(rewards))


def train(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    with bridge_process() as target:
        algo = build(config(name, args, out), target)
        try:
            history = algo.train(args.steps, progress_bar=True)
        finally:
            algo.inference.close()
    rewards = [r["reward"] for r in history]
    return {
        "rewards": rewards,
        "first": rewards[0],
        "last2": float(np.mean(rewards[-2:])),
        "rollout_s": float(np.mean([r["rollout_s"] for r in history])),
        "train_s": float(np.mean([r["train_s"] for r in history])),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=["grpo", "ppo", "reinforce"])
    parser.add_argument("--out", default="bench/out/algorithms")
    args = parser.parse_args()
    out = Path(args.out)
    base = untrained(args, out)
    results = {name: train(name, args, out) for name in args.only}
    rows = [("untrained model, batches of the last two steps", f"{base:.3f}", "baseline")]
    for name, r in results.items():
        rows += [
            (f"{name}: mean reward step 1 -> last two steps", f"{r['first']:.3f} -> {r['last2']:.3f}", ""),
            (f"{name}: gain over the untrained baseline", f"{r['last2'] - base:+.3f}", ">= +0.15"),
            (f"{name}: rollout / train s per step", f"{r['rollout_s']:.1f} / {r['train_s']:.1f}", ""),
        ]
    record(
        "algorithms",
        f"PPO, GRPO, REINFORCE on the calculator task ({args.steps} steps, groups of {args.group_size}, lr {args.lr})",
        rows,
        {"untrained_last2": base, "args": vars(args), "results": results},
        notes="Per-step rewards: "
        + "; ".join(f"{n}: {[round(x, 3) for x in r['rewards']]}" for n, r in results.items()),
    )


if __name__ == "__main__":
    main()
