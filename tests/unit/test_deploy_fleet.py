"""The fleet in the deployment files: the chart's control plane and the compose `control` service (issue 21).

Checked with the real tools, like tests/unit/test_deploy.py: Helm's Go SDK renders the chart (every manifest
validated against the Kubernetes schemas), Compose v2 normalises the compose file; the bridges' rendered
environment must load as real settings with the fleet on, and the chart refuses several bridges without
persistence.
"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest

from server.config import load_settings
from tests.unit.test_deploy import KUBE_VERSIONS, bridge_environment, by_kind, compose_config, render


def test_chart_deploys_the_control_plane_and_the_bridges_join_the_fleet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = render()
    control = by_kind(docs, "Deployment")["primerl-control"]
    (container,) = control["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["primerl", "control", "serve"]
    assert container["readinessProbe"]["grpc"]["port"] == 50061
    assert {p["port"] for p in by_kind(docs, "Service")["primerl-control"]["spec"]["ports"]} == {50061, 9310}
    for doc in (control, by_kind(docs, "Service")["primerl-control"]):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)

    env = bridge_environment(docs, tmp_path, {})
    for key, value in env.items():
        monkeypatch.setenv(key, value.replace("$(POD_IP)", env["POD_IP"]))
    s = load_settings()
    assert s.fleet.enabled and s.persistence.enabled and s.redis.url
    assert s.fleet.advertise_address == "10.0.0.7:50051" and s.fleet.bridge_id == "primerl-bridge-0"

    off = render({"controlPlane": {"enabled": False}})
    assert "primerl-control" not in by_kind(off, "Deployment")
    names = {
        e["name"]
        for e in by_kind(off, "Deployment")["primerl-bridge"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert "PRIMERL_FLEET__ENABLED" not in names


@pytest.mark.parametrize(
    "bridge",
    [
        {"persistence": False},  # the HPA may run up to 10 bridges
        {"persistence": False, "autoscaling": {"enabled": False}, "replicas": 2},
    ],
)
def test_several_bridges_without_persistence_fail_to_render(bridge: dict[str, object]) -> None:
    with pytest.raises(helm.HelmError, match=r"bridge\.persistence is false with up to"):
        render({"bridge": bridge})


def test_one_bridge_may_run_without_persistence() -> None:
    docs = render({"bridge": {"persistence": False, "autoscaling": {"enabled": False}, "replicas": 1}})
    env = by_kind(docs, "Deployment")["primerl-bridge"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "PRIMERL_PERSISTENCE__ENABLED", "value": "false"} in env


def test_compose_runs_the_control_plane_and_the_bridge_registers_with_it() -> None:
    services = compose_config()["services"]
    control = services["control"]
    assert control["entrypoint"][:3] == ["primerl", "control", "serve"]
    assert {(p["target"], p["published"]) for p in control["ports"]} == {(50061, "50061")}
    assert control["environment"]["PRIMERL_REDIS__URL"] == services["primerl"]["environment"]["PRIMERL_REDIS__URL"]
    assert control["healthcheck"]["test"][1:] == ["python", "scripts/grpc_health.py", "127.0.0.1:50061"]
    assert services["primerl"]["environment"]["PRIMERL_FLEET__ENABLED"] == "true"
