"""LLMServeEnv agents: PPO vs heuristic vs random, 20 held-out episodes x 3 tasks (issue 20, acceptance 4).

One run on this machine: for each task, ``llmserve.ppo.train`` (behaviour-cloning warm start
from the heuristic, then PPO on training seeds >= ``TRAIN_SEED_BASE``), timed (wall clock and the
process's CPU time: the machine is shared, so the wall clock may wait); then every agent plays the
held-out seeds ``0..episodes-1`` and each episode is graded by ``grader.grade`` (random floor 0,
heuristic reference 0.5). Figures: mean episode return and mean grade per agent per task, the
margins PPO - heuristic and heuristic - random (mean return), and whether PPO > heuristic > random.

    .venv/bin/python bench/llmserve.py [--steps 20000] [--episodes 20] [--seed 0] [--skip-train]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import BENCH, record
from llmserve.evaluate import Cell, evaluate
from llmserve.ppo import TrainConfig, train
from llmserve.tasks import TASKS

AGENTS = ["ppo", "heuristic", "random"]
PLOT = BENCH / "plots" / "llmserve_agents.png"


def plot(cells: list[Cell]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    PLOT.parent.mkdir(exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    tasks = list(dict.fromkeys(c.task_id for c in cells))
    for ax, what in zip(axes, ("returns", "grades"), strict=True):
        for j, agent in enumerate(AGENTS):
            row = [next(c for c in cells if c.task_id == t and c.agent == agent) for t in tasks]
            vals = [np.asarray(getattr(c, what)) for c in row]
            means = [v.mean() for v in vals]
            errs = [v.std(ddof=1) / np.sqrt(len(v)) for v in vals]
            ax.bar(np.arange(len(tasks)) + (j - 1) * 0.27, means, 0.27, yerr=errs, capsize=3, label=agent)
        ax.set_xticks(range(len(tasks)), [t.replace("_", "\n") for t in tasks])
        ax.set_ylabel(f"mean episode {what[:-1]} (± s.e.)")
        ax.axhline(0, color="grey", lw=0.5)
    axes[0].legend()
    fig.suptitle("LLMServeEnv: PPO vs heuristic vs random, held-out seeds")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)
    return PLOT.relative_to(BENCH).as_posix()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="PPO environment steps per task (after BC)")
    ap.add_argument("--episodes", type=int, default=20, help="held-out episodes per agent and task (seeds 0..N-1)")
    ap.add_argument("--seed", type=int, default=0, help="training seed")
    ap.add_argument("--out", default=str(BENCH / "out" / "llmserve_ppo"), help="weights directory")
    ap.add_argument("--skip-train", action="store_true", help="evaluate the weights already in --out")
    args = ap.parse_args()
    train_s: dict[str, tuple[float, float]] = {}
    if not args.skip_train:
        for task_id in TASKS:
            wall, cpu = time.perf_counter(), time.process_time()
            train(TrainConfig(task_id=task_id, steps=args.steps, seed=args.seed), Path(args.out))
            train_s[task_id] = (time.perf_counter() - wall, time.process_time() - cpu)
    cells = evaluate(AGENTS, list(TASKS), list(range(args.episodes)), args.out)
    rows: list[tuple[str, str, str]] = []
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for task_id in TASKS:
        by = {c.agent: c for c in cells if c.task_id == task_id}
        p, h, r = by["ppo"], by["heuristic"], by["random"]
        ordered = p.mean_return > h.mean_return > r.mean_return and p.mean_grade > h.mean_grade > r.mean_grade
        rows.append(
            (
                f"{task_id}: mean return ppo / heuristic / random",
                f"{p.mean_return:.3f} / {h.mean_return:.3f} / {r.mean_return:.3f}",
                "ppo > heuristic > random",
            )
        )
        rows.append(
            (
                f"{task_id}: mean grade ppo / heuristic / random",
                f"{p.mean_grade:.3f} / {h.mean_grade:.3f} / {r.mean_grade:.3f}",
                "ppo > heuristic > random",
            )
        )
        rows.append(
            (
                f"{task_id}: margins (return) ppo-heuristic, heuristic-random; order holds",
                f"{p.mean_return - h.mean_return:+.3f}, {h.mean_return - r.mean_return:+.3f}; {ordered}",
                "> 0, > 0; True",
            )
        )
        if task_id in train_s:
            w, c = train_s[task_id]
            rows.append(
                (
                    f"{task_id}: PPO training time ({args.steps} steps + BC)",
                    f"{w:.0f} s wall, {c:.0f} s CPU",
                    "<= 1200 s",
                )
            )
        wall_cpu = train_s.get(task_id)
        figures[task_id] = {
            "agents": {a: {"returns": by[a].returns, "grades": by[a].grades} for a in AGENTS},
            "train_wall_s": wall_cpu[0] if wall_cpu else None,
            "train_cpu_s": wall_cpu[1] if wall_cpu else None,
        }
        ratios[f"{task_id}_ppo_minus_heuristic_return"] = p.mean_return - h.mean_return
        ratios[f"{task_id}_heuristic_minus_random_return"] = h.mean_return - r.mean_return
    record(
        "llmserve",
        f"LLMServeEnv agents: PPO vs heuristic vs random ({args.episodes} held-out seeds x {len(TASKS)} tasks)",
        rows,
        figures,
        f"Held-out seeds 0..{args.episodes - 1}; PPO trained on seeds >= 100000 (seed {args.seed}), greedy at "
        "evaluation. Grade: 0 = random's return on the same seed, 0.5 = the heuristic's (grader.py). Same "
        "2-core shared machine for all agents; training wall time includes waiting for other work.",
        ratios=ratios,
        plots=(plot(cells),),
    )


if __name__ == "__main__":
    main()
