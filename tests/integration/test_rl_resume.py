"""``primerl rl`` checkpoints resume bit-exactly (issue 23, acceptance 2).

``primerl rl @ examples/grpo.toml --max-steps 4 --ckpt --ckpt.interval 2`` runs uninterrupted and checkpoints steps
2 and 4; a second run, ``--max-steps 4 --ckpt.resume-step 2`` from the first's checkpoints (its own run directory, a
fresh bridge child given the checkpoint's weights under the checkpoint's policy version), has the losses, gradient
norms and rewards of the first run's steps 3-4 (6 steps and a resume from 3 until the test-loop issue 33: the same
assertions on two fewer compared steps; every step of this config trains). The rollouts are shrunk (groups of 4, one
episode at a time so the engine's batching is the same in every run, no held-out evaluation) to keep the test short;
everything else is the shipped example config, whose task the untrained model mostly fails, so most steps' groups
disagree and train (non-zero gradients in steps 3-4 are checked: step 3's update uses the optimizer moments restored
from step 2, and step 4's figures show them; the weights alone would not).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--rollout.group-size", "4",
    "--rollout.max-concurrent", "1",
    "--max-minutes", "0",
    "--eval.problems", "0",
    "--log-level", "WARNING",
]  # fmt: skip


def primerl_rl(out: Path, *flags: str) -> list[dict[str, float]]:
    cmd = [sys.executable, "-m", "server", "rl", "@", "examples/grpo.toml", "--out-dir", str(out), *SMALL, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(2400)
def test_resumed_steps_equal_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = primerl_rl(tmp_path / "a", "--max-steps", "4", "--ckpt", "--ckpt.interval", "2")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    checkpoints = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_4"]
    resumed = primerl_rl(tmp_path / "b", "--max-steps", "4", "--ckpt.dir", str(checkpoints), "--ckpt.resume-step", "2")
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    keys = ("reward", "reward_std", "loss", "grad_norm", "policy_version", "trained_tokens", "clip_frac")
    for got, want in zip(resumed[-2:], straight[2:], strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (got["step"], got, want)
    # the compared steps trained: a group whose rewards differed has a non-zero gradient (GRPO's loss value itself
    # is ~0 by construction, a group's advantages sum to zero)
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in straight[2:]), straight[2:]
