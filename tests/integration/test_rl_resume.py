"""``primerl rl`` checkpoints resume bit-exactly (issue 23, acceptance 2).

``primerl rl @ examples/grpo.toml --max-steps 6 --ckpt --ckpt.interval 3``, then ``--max-steps 10
--ckpt.resume-step 6``: steps 7-10 of the resumed run (a fresh bridge child, given the checkpoint's weights
under the checkpoint's policy version) have the losses and rewards of an uninterrupted 10-step run. The
rollouts are shrunk (groups of 4 on the two-operand task, short turns, one episode at a time so the engine's
batching is the same in every run) to keep the test short; everything else is the shipped example config.
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
    "--task.ops", "+-",  # make run's task is the hard one; on this one groups of 4 disagree, so steps 7-10 train
    "--task.operands", "2",
    "--rollout.group-size", "4",
    "--rollout.turn-max-tokens", "[12, 4]",
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


@pytest.mark.timeout(3000)
@pytest.mark.xfail(
    strict=True,
    reason="issue 23, acceptance 2 not shown yet: steps 7-10 of the resumed and the uninterrupted run are equal, but "
    "in this configuration every group's rewards tie in steps 7-10 (loss 0, grad_norm 0), so the guard that the "
    "compared steps carry a learning signal fails and optimizer-state restoration is not exercised (fresh-clone "
    "make test, 2026-11-25). strict: the run fails the moment the test starts passing, so the mark is removed then.",
)
def test_resumed_steps_equal_an_uninterrupted_run(tmp_path: Path) -> None:
    first = primerl_rl(tmp_path / "a", "--max-steps", "6", "--ckpt", "--ckpt.interval", "3")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_3", "step_6"]
    resumed = primerl_rl(tmp_path / "a", "--max-steps", "10", "--ckpt.resume-step", "6")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # one metrics file per run directory
    straight = primerl_rl(tmp_path / "b", "--max-steps", "10")
    assert [r["step"] for r in straight] == list(range(1, 11))
    keys = ("reward", "loss", "policy_version", "trained_tokens", "clip_frac")
    for got, want in zip(resumed[6:], straight[6:], strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (got["step"], got, want)
    # the learning signal was not trivially zero: some step of 7-10 trained on a non-zero loss
    assert any(r["loss"] != 0.0 for r in straight[6:]) or any(r["grad_norm"] > 0 for r in straight[6:])
