"""The verifier in the deployment files: docker compose's `verifier` service and the chart's optional Deployment.

Checked with the real tools, like tests/unit/test_deploy.py: Compose v2 normalises the compose file (its
environment must load as real verifier settings), Helm's Go SDK renders and lints the chart, and every
rendered manifest validates against the Kubernetes schemas.
"""

from __future__ import annotations

import argparse

import helm_python as helm
import kubernetes_validate
import pytest

from tests.unit.test_deploy import CHART, KUBE_VERSIONS, by_kind, compose_config, render
from verifier.cli import load_config

ON = {"verifier": {"enabled": True}}


def test_compose_verifier_serves_grpc_and_http_from_a_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    svc = compose_config()["services"]["verifier"]
    assert svc["entrypoint"] == ["primerl", "verifier", "serve"]
    assert {(p["target"], p["published"]) for p in svc["ports"]} == {(8700, "8700"), (8701, "8701")}
    assert svc["healthcheck"]["test"][1:] == ["python", "scripts/grpc_health.py", "127.0.0.1:8701"]
    volume = next(v for v in svc["volumes"] if v["type"] == "volume")
    for key, value in svc["environment"].items():
        monkeypatch.setenv(key, value)
    config = load_config(argparse.Namespace())
    assert (config.host, config.grpc_port, config.http_port) == ("0.0.0.0", 8701, 8700)
    assert config.database_url.removeprefix("sqlite:///").startswith(volume["target"])
    assert config.key_dir.startswith(volume["target"]) and config.bridge == "primerl:50051"


def test_chart_verifier_is_off_by_default_and_renders_valid_manifests_when_on() -> None:
    assert not [d for d in render() if "verifier" in d["metadata"]["name"]]
    docs = render(ON)
    deployment = by_kind(docs, "Deployment")["primerl-verifier"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["primerl", "verifier", "serve"]
    assert container["readinessProbe"]["grpc"]["port"] == 8701
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PRIMERL_VERIFIER__DATABASE_URL"] == "sqlite:////var/lib/primerl-verifier/log.sqlite3"
    service = by_kind(docs, "Service")["primerl-verifier"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 8701, "http": 8700}
    assert (
        by_kind(docs, "PersistentVolumeClaim")["primerl-verifier"]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    )
    pg = render(
        {"verifier": {"enabled": True, "databaseUrl": "postgresql://v@db/log", "persistence": {"enabled": False}}}
    )
    container = by_kind(pg, "Deployment")["primerl-verifier"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in container["env"]}[
        "PRIMERL_VERIFIER__DATABASE_URL"
    ] == "postgresql://v@db/log"
    assert "primerl-verifier" not in by_kind(pg, "PersistentVolumeClaim")
    for doc in docs + pg:
        if "verifier" in doc["metadata"]["name"]:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    report = helm.lint(CHART, ON, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
