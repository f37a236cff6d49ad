"""The performance gate's comparison logic (bench/gate.py): direction, tolerance, missing figures, message."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gate import BASELINES, check, table

SPEC = {
    "a.lower_is_better": {"value": 1.0, "better": "lower", "tolerance": 0.1},
    "b.higher_is_better": {"value": 2.0, "better": "higher", "tolerance": 0.5},
}


def test_within_tolerance_passes_and_beyond_fails() -> None:
    ok = check({"a.lower_is_better": 1.1, "b.higher_is_better": 1.5}, SPEC)
    assert all(v.ok for v in ok)
    bad = check({"a.lower_is_better": 1.2, "b.higher_is_better": 1.4}, SPEC)
    assert [v.ok for v in bad] == [False, False]
    assert "REGRESSED" in table(bad) and "+0.2" in table(bad)


def test_a_missing_figure_fails() -> None:
    verdicts = check({"a.lower_is_better": 0.5}, SPEC)
    assert [(v.figure, v.ok) for v in verdicts] == [("a.lower_is_better", True), ("b.higher_is_better", False)]
    assert "missing" in table(verdicts)


def test_committed_baselines_are_well_formed() -> None:
    baselines = json.loads(Path(BASELINES).read_text())
    assert set(baselines) == {"fast", "full"}
    for section in baselines.values():
        for name, spec in section.items():
            assert spec["better"] in ("lower", "higher"), name
            assert spec["tolerance"] >= 0 and "why" in spec, name
