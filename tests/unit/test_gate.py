"""The performance gate's comparison logic (bench/gate.py): direction, tolerance, missing figures, message; the fast
probes' figures. The full gate's baselines, noise bands and targets report: test_gate_targets.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.gate import BASELINES, check, measured_noise, table

SPEC = {
    "a.lower_is_better": {"value": 1.0, "better": "lower", "tolerance": 0.1},
    "b.higher_is_better": {"value": 2.0, "better": "higher", "tolerance": 0.5},
}


def test_within_tolerance_passes_and_beyond_fails() -> None:
    ok = check({"a.lower_is_better": 1.1, "b.higher_is_better": 1.5}, SPEC)
    assert all(v.ok for v in ok)
    assert [v.tolerance for v in ok] == [pytest.approx(0.1), pytest.approx(0.5)]  # scripts/dev_loop.sh's CSV
    bad = check({"a.lower_is_better": 1.2, "b.higher_is_better": 1.4}, SPEC)
    assert [v.ok for v in bad] == [False, False]
    assert "REGRESSED" in table(bad) and "+20.0 %" in table(bad) and "-30.0 %" in table(bad)


def test_a_missing_figure_fails() -> None:
    verdicts = check({"a.lower_is_better": 0.5}, SPEC)
    assert [(v.figure, v.ok) for v in verdicts] == [("a.lower_is_better", True), ("b.higher_is_better", False)]
    assert "MISSING" in table(verdicts)


def test_committed_baselines_are_well_formed() -> None:
    baselines = json.loads(Path(BASELINES).read_text())
    assert set(baselines) == {"fast", "full"}
    for section in baselines.values():
        for name, spec in section.items():
            assert spec["better"] in ("lower", "higher"), name
            assert "why" in spec, name
    for name, spec in baselines["fast"].items():
        assert spec["tolerance"] >= 0, name
    for name, spec in baselines["full"].items():
        base = spec["baseline"]
        assert base["recorded"] and base["noise_from"].strip() and base["runs"], name
        # The band covers the spread of the runs it names: any of them passes against a baseline from another.
        assert base["noise"] >= measured_noise(base["runs"]), name


def test_the_fleet_probes_pass_and_an_injected_round_robin_fails_them() -> None:
    """The seeded simulator figures in the fast gate: unchanged code passes; cache-aware made round-robin fails."""
    from bench.gate import fleet_probes

    fast = json.loads(Path(BASELINES).read_text())["fast"]
    fleet = {k: v for k, v in fast.items() if k.startswith("fleet.")}
    assert fleet
    assert all(v.ok for v in check(fleet_probes(None), fleet))
    broken = check(fleet_probes("round-robin"), fleet)
    assert not any(v.ok for v in broken)
    assert "REGRESSED" in table(broken)


def test_results_md_is_regenerated_from_the_json_and_keeps_the_run_log(tmp_path: Path, monkeypatch: Any) -> None:
    from bench import report

    monkeypatch.setattr(report, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(report, "RESULTS_JSON", tmp_path / "results")
    (tmp_path / "RESULTS.md").write_text("# Benchmark results\n\nold intro\n\n### Old run — 2026-01-01\n\n| a | b |\n")
    (tmp_path / "results").mkdir()
    payload = {
        "benchmark": "fleet_sim",
        "title": "Fleet simulator",
        "date": "2026-11-23 01:00",
        "machine": "test box",
        "rows": [["cache_aware / round_robin", "2.10x", ">= 2x"]],
        "ratios": {"agentic_cache_aware_over_round_robin_tput": 2.1},
        "plots": ["plots/fleet_sim.png"],
    }
    (tmp_path / "results" / "fleet_sim.json").write_text(json.dumps(payload))
    report.regenerate()
    report.append_run("### New run — 2026-11-23\n")
    report.regenerate()  # idempotent: the log is kept once, the summary rebuilt
    text = (tmp_path / "RESULTS.md").read_text()
    summary, log = text.split(report.END)
    assert "| cache_aware / round_robin | 2.10x | >= 2x |" in summary
    assert (
        "`agentic_cache_aware_over_round_robin_tput` 2.1" in summary and "![fleet_sim](plots/fleet_sim.png)" in summary
    )
    assert log.count("### Old run") == 1 and log.count("### New run") == 1 and log.count("## Run log") == 1
    assert log.index("### Old run") < log.index("### New run")
    assert "old intro" not in text


def test_primerl_bench_lists_the_matrix() -> None:
    import subprocess
    import sys

    from bench.matrix import MATRIX

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "server", "bench", "--list"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()] == [b.name for b in MATRIX]
    bad = subprocess.run([sys.executable, "-m", "server", "bench", "--only", "nope"], cwd=root, capture_output=True)
    assert bad.returncode == 2 and b"invalid choice" in bad.stderr
