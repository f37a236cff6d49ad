"""The reference GRPO trainer end to end: a bridge subprocess on the embedded engine, real rollouts, an
optimizer step, UpdateWeights, a checkpoint, and ``--resume`` continuing from it (tiny settings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--group-size", "2", "--call-tokens", "6", "--answer-tokens", "3", "--no-record", "--max-minutes", "30"]


def run_trainer(out: Path, *extra: str) -> dict[str, object]:
    cmd = [sys.executable, "examples/grpo_train.py", "--out", str(out), *TINY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads((out / "history.json").read_text()))


@pytest.mark.timeout(1500)
def test_trainer_steps_pushes_weights_and_resumes(tmp_path: Path) -> None:
    first = run_trainer(tmp_path, "--steps", "1")
    steps = first["steps"]
    assert isinstance(steps, list) and [s["step"] for s in steps] == [0]
    assert (tmp_path / "trainer_state.pt").exists() and (tmp_path / "weights" / "model.safetensors").exists()
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    # on-policy: the trainer's recomputed logprobs match the engine's (ratio 1) whenever a step trained
    assert steps[0]["ratio"] == pytest.approx(1.0, abs=1e-3) or steps[0]["loss"] == 0.0
    second = run_trainer(tmp_path, "--steps", "2", "--resume")
    steps2 = second["steps"]
    assert isinstance(steps2, list) and [s["step"] for s in steps2] == [0, 1]
    # a fresh bridge was given the resumed weights first (v1), and step 1 trained on samples from it
    assert steps2[1]["version"] == 1 and steps2[1]["lag"] == 0
