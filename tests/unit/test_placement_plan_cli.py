"""Plan outputs (YAML/JSON, launch commands, Helm values, mig-parted, replica list) and the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from placement.mig.config import PlannerOptions, load_fleet, load_models
from placement.mig.endpoints import load_endpoints
from placement.mig.plan import Plan
from placement.mig.problem import build_problem
from placement.mig.solver import solve
from server.cli import main
from tests.unit.test_deploy import by_kind, render

REPO = Path(__file__).resolve().parents[2]
FLEET = str(REPO / "examples/placement/fleet.yaml")
MODELS = str(REPO / "examples/placement/models.yaml")
CHART = REPO / "k8s" / "HelmChart"


@pytest.fixture(scope="module")
def plan() -> Plan:
    fleet = load_fleet(FLEET)
    models, archs = load_models(MODELS)
    prob = build_problem(fleet, models, archs, PlannerOptions(solver="heuristic"))
    return Plan(prob, solve(prob))


def test_plan_round_trips_through_yaml_and_json(plan: Plan) -> None:
    data = plan.to_dict()
    assert yaml.safe_load(plan.dump("yaml")) == data
    assert json.loads(plan.dump("json")) == json.loads(json.dumps(data))
    assert data["summary"]["gpus_total"] == 14
    assert "mig-parted" in data["catalog_source"]


def test_replicas_carry_kv_capacity_and_flags_that_realise_it(plan: Plan) -> None:
    data = plan.to_dict()
    assert data["replicas"]
    by_id = {r["id"]: r for r in data["replicas"]}
    assert len(by_id) == len(data["replicas"])  # ids are unique
    for rep, ep in zip(plan.sol.replicas, plan.endpoints(), strict=True):
        assert ep.kv_capacity_tokens == rep.perf.budget.kv_tokens > 0
        cmd = by_id[ep.id]["command"]
        if plan.specs[rep.model].engine == "vllm":
            assert f"--kv-cache-memory-bytes {rep.perf.budget.kv_cache_bytes}" in cmd
            assert "--enable-prefix-caching" in cmd  # the launch profile's RL flags are kept
            assert f"--max-model-len {plan.specs[rep.model].demand.context_len}" in cmd
            assert ("--tensor-parallel-size" in cmd) == (len(rep.gpu_indices) > 1)
        assert ("MIG-uuid" in cmd) == (rep.profile is not None)
    assert [e["id"] for e in data["bridge_replicas"]] == [r["id"] for r in data["replicas"]]


def _keys(values: Any, prefix: str = "") -> set[str]:
    if not isinstance(values, dict):
        return {prefix}
    return {k for key, v in values.items() for k in _keys(v, f"{prefix}.{key}" if prefix else str(key))}


def test_helm_values_render_the_chart_with_the_plans_replicas_and_devices(plan: Plan) -> None:
    """Every plan device shape becomes a release the chart renders: its StatefulSet runs the plan's
    replica count on the plan's MIG slice (or GPUs), and the bridge is pointed at those replicas."""
    releases = plan.helm_values()
    shapes = Counter((r.model, r.profile, len(r.gpu_indices)) for r in plan.sol.replicas)
    assert len(releases) == len(shapes) and any(p for _, p, _ in shapes)  # the example plan uses MIG
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    selectors = {f"engines.{t}.nodeSelector.kubernetes.io/hostname" for t in chart_values["engines"]}
    known = _keys(chart_values) | selectors
    for name, values in releases.items():
        assert _keys(values) <= known, _keys(values) - known  # only keys the chart has
        assert not helm.lint(CHART, values, strict=True)["errors"], name
        engine, model = values["bridge"]["engine"]["type"], values["bridge"]["engine"]["model"]
        pool = values["engines"][engine]
        [(_, profile, tp)] = [
            k
            for k in shapes
            if k[0] == model and (k[1] or "") == pool["gpu"]["migProfile"] and (k[1] or k[2] == pool["gpu"]["count"])
        ]
        docs = render(values)
        sets = by_kind(docs, "StatefulSet")
        assert [n for n in sets if n != "primerl-redis"] == [f"primerl-{engine}"]  # the other engine pools are off
        spec = sets[f"primerl-{engine}"]["spec"]
        assert spec["replicas"] == shapes[(model, profile, tp)]
        container = spec["template"]["spec"]["containers"][0]
        expected = {f"nvidia.com/mig-{profile}": 1} if profile else {"nvidia.com/gpu": tp}
        assert container["resources"]["limits"].items() >= expected.items()
        flags = container.get("args") or container["command"]
        assert "--kv-cache-memory-bytes" in flags or "--mem-fraction-static" in flags  # the plan's KV budget
        bridge = by_kind(docs, "Deployment")["primerl-bridge"]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in bridge["env"]}
        assert (
            env["PRIMERL_ENGINE__MODEL"] == model and len(json.loads(env["PRIMERL_ENGINE__URLS"])) == spec["replicas"]
        )


def test_the_bridge_reads_back_the_replica_list_a_plan_file_carries(plan: Plan, tmp_path: Path) -> None:
    for fmt in ("json", "yaml"):
        (tmp_path / f"plan.{fmt}").write_text(plan.dump(fmt))
        assert load_endpoints(tmp_path / f"plan.{fmt}") == plan.endpoints()


def test_mig_parted_config_matches_the_geometries(plan: Plan) -> None:
    cfg = plan.mig_parted_config()
    for g in plan.sol.gpus:
        entries = cfg["mig-configs"][f"primerl-{g.node}"]
        [entry] = [e for e in entries if g.index in e["devices"]]
        assert entry["mig-enabled"] == g.mig
        if g.mig:
            assert entry["mig-devices"] == dict(Counter(p for p, _ in g.placements))


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    rc = main(
        ["placement", "plan", "--fleet", FLEET, "--models", MODELS, "--solver", "heuristic", "--output", str(out_file)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("solver heuristic")
    assert "replica" in out and "KV tokens" in out and "tok/s" in out
    assert "policy-qwen2.5-7b" in out
    assert json.loads(out_file.read_text())["solver"] == "heuristic"


def test_cli_yaml_output_and_no_mig_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "placement",
                "plan",
                "--fleet",
                FLEET,
                "--models",
                MODELS,
                "--solver",
                "heuristic",
                "--no-mig",
                "--format",
                "yaml",
            ]
        )
        == 0
    )
    data = yaml.safe_load(capsys.readouterr().out)
    assert all(not g["mig"] or g["node"] == "a100-legacy" for g in data["gpus"])  # only the kept layouts stay MIG


def test_cli_bad_file_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("nodes:\n  - {name: a, gpu: H100-90GB}\n")
    assert main(["placement", "plan", "--fleet", str(bad), "--models", MODELS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "nodes[0].gpu" in err and "H100-90GB" in err
