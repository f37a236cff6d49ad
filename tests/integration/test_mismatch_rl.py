"""The mismatch monitor in a real ``primerl rl @ examples/grpo.toml`` run (issue 38, acceptance 1).

With the embedded engine and the trainer both in deterministic mode (``engine.embedded.batch_invariant``,
``trainer.batch_invariant``), the exact answer is known: every trained token's trainer logprob equals the one the
engine sampled it with, so each step's ``mismatch/*`` figures in ``metrics.jsonl`` must be exactly 0 and its mean
ratio exactly 1. (``test_rl_resume`` checks the same fields of a default-mode run: present, small, not zero;
``tests/unit/test_grpo_mismatch.py`` checks them against a hand computation with an injected mismatch.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_rl_resume import primerl_rl

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

DETERMINISTIC = ["--trainer.batch-invariant", "true", "--bridge.args", '["--engine.embedded.batch-invariant", "true"]']


@pytest.mark.timeout(1800)
def test_deterministic_run_reports_exactly_zero_mismatch_every_step(tmp_path: Path) -> None:
    rows = primerl_rl(tmp_path / "run", "--max-steps", "2", *DETERMINISTIC)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["mismatch/tokens"] > 0 and row["mismatch/sampled/tokens"] == row["mismatch/tokens"], row
        for name in ("k3_kl", "abs_mean", "abs_max", "out_0.9_1.1", "out_0.5_2"):
            assert row[f"mismatch/{name}"] == 0.0, (name, row)
        assert row["ratio"] == 1.0, row
