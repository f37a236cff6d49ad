"""The run's PNG: reward per step and, below it, the trainer-inference mismatch (``primerl rl`` in one process
and as three)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """The reward curve (mean reward and correct answers per step) and, below it, the trainer-inference mismatch
    (``grpo.mismatch``: k3 KL and max |d logprob| of the on-policy tokens, log scale) as a PNG."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 6), height_ratios=(2, 1), sharex=True)
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["reward"] for r in history], marker="o", label="mean reward")
    if history and "reward/correct" in history[0]:
        ax.plot(steps, [r["reward/correct"] for r in history], marker=".", linestyle="--", label="correct answer")
    ax.set(ylabel="reward (0-1)", ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    for key, label in (("mismatch/k3_kl", "k3 KL"), ("mismatch/abs_max", "max |d logprob|")):
        points = [(r["step"], r[key]) for r in history if r.get(key, math.nan) > 0]  # NaN: nothing on-policy
        if points:
            low.plot(*zip(*points, strict=True), marker=".", label=label)
    low.set(xlabel="step", ylabel="trainer vs engine")
    if low.lines:
        low.set_yscale("log")
        low.legend()
    low.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["plot"]
