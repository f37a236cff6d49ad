"""Metric definitions, the dashboard and alerts against the registry, and the dump analysis script."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from prometheus_client import generate_latest

from cache.config import CacheConfig
from cache.index import MemoryIndex
from cache.redis_index import RedisIndex
from core.types import Usage
from engines.config import ToyConfig
from engines.toy import ToyEngine
from observability.metrics import LATENCY_BUCKETS, BridgeMetrics, FailOpenCounting, exposed_names
from server.bridge import Bridge
from server.config import AdmissionConfig, SamplingDefaults

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "HelmChart" / "dashboards" / "grafana.json"
ALERTS = ROOT / "k8s" / "HelmChart" / "files" / "alerts.yml"
SCRIPT = ROOT / "scripts" / "analyze_metrics.py"
METRIC = re.compile(r"\b(primerl_[a-zA-Z0-9_]+)")
BOUNDED_LABELS = {"model", "engine", "replica", "method", "code", "finish_reason", "source", "component", "name", "le"}


def bridge_metrics() -> tuple[BridgeMetrics, Bridge]:
    metrics = BridgeMetrics()
    engine = ToyEngine(ToyConfig(), replica="toy-0")
    bridge = Bridge([engine], AdmissionConfig(), SamplingDefaults(), metrics)
    metrics.attach(bridge)
    return metrics, bridge


def analyze_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("analyze_metrics", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_a_turn_is_counted_once_with_its_tokens_and_latencies() -> None:
    metrics, _ = bridge_metrics()
    metrics.observe_turn("m", "toy", "stop", Usage(prompt_tokens=100, cached_tokens=60, generated_tokens=11), 0.3, 0.1)
    metrics.observe_turn("m", "toy", "abort", Usage(prompt_tokens=50, cached_tokens=0, generated_tokens=0), 0.02, 0.0)
    r = metrics.registry
    me = {"model": "m", "engine": "toy"}
    assert r.get_sample_value("primerl_prompt_tokens_total", me) == 150
    assert r.get_sample_value("primerl_cached_tokens_total", me) == 60
    assert r.get_sample_value("primerl_generated_tokens_total", me) == 11
    assert r.get_sample_value("primerl_turns_total", {**me, "finish_reason": "abort"}) == 1
    assert r.get_sample_value("primerl_step_latency_seconds_count", me) == 2
    assert r.get_sample_value("primerl_step_latency_seconds_bucket", {**me, "le": "0.025"}) == 1
    assert r.get_sample_value("primerl_ttft_seconds_count", me) == 1  # a turn with no token has no TTFT
    assert r.get_sample_value("primerl_decode_tokens_per_second_sum", me) == pytest.approx(10 / 0.2)
    ratio = {**me, "source": "engine"}
    assert r.get_sample_value("primerl_prefix_cache_hit_ratio", ratio) == pytest.approx(60 / 150)
    metrics.observe_index_lookup("m", 200, 150)
    assert r.get_sample_value("primerl_prefix_cache_hit_ratio", {"model": "m", "engine": "", "source": "index"}) == 0.75


def test_engine_counters_and_kv_are_read_at_scrape_time() -> None:
    metrics, bridge = bridge_metrics()
    engine = bridge.engines[0]
    labels = {"engine": "toy", "replica": "toy-0"}
    assert metrics.registry.get_sample_value("primerl_kv_bytes", labels) is None  # not reported: no series
    engine.counters.prefill_tokens = 42
    engine.counters.extra.update(kv_bytes=4096, kv_capacity_bytes=16384, evictions=3)
    metrics.engine_health["toy-0"] = False
    r = metrics.registry
    assert r.get_sample_value("primerl_engine_prefill_tokens_total", labels) == 42
    assert r.get_sample_value("primerl_kv_bytes", labels) == 4096
    assert r.get_sample_value("primerl_engine_kv_usage_ratio", labels) == 0.25
    assert r.get_sample_value("primerl_engine_stat", {**labels, "name": "evictions"}) == 3
    assert r.get_sample_value("primerl_engine_healthy", labels) == 0
    assert r.get_sample_value("primerl_active_episodes", {"model": "toy"}) == 0
    engine.counters.extra["kv_usage_ppm"] = 500_000  # an engine-reported fraction wins
    assert r.get_sample_value("primerl_engine_kv_usage_ratio", labels) == 0.5


def test_speculation_and_component_fail_opens_are_read_at_scrape_time() -> None:
    metrics, bridge = bridge_metrics()
    engine = bridge.engines[0]
    r = metrics.registry
    mer = {"model": "toy", "engine": "toy", "replica": "toy-0"}
    assert r.get_sample_value("primerl_speculation_drafted_tokens_total", mer) is None  # never drafted: no series
    engine.counters.extra.update(spec_drafted=10, spec_accepted=7, spec_forwards=4)
    assert r.get_sample_value("primerl_speculation_drafted_tokens_total", mer) == 10
    assert r.get_sample_value("primerl_speculation_accepted_tokens_total", mer) == 7
    stat = {"engine": "toy", "replica": "toy-0"}
    assert r.get_sample_value("primerl_engine_stat", {**stat, "name": "spec_drafted"}) is None  # exported once
    assert r.get_sample_value("primerl_engine_stat", {**stat, "name": "spec_forwards"}) == 4

    metrics.fail_open.labels("persistence").inc()
    seen = {"redis": 0}
    metrics.watch_fail_open(lambda: seen.items())
    seen["redis"] = 3  # counted by the component itself, read at the next scrape
    assert r.get_sample_value("primerl_fail_open_total", {"component": "redis"}) == 3
    assert r.get_sample_value("primerl_fail_open_total", {"component": "persistence"}) == 1
    assert isinstance(RedisIndex("redis://127.0.0.1:1/0", CacheConfig()), FailOpenCounting)
    assert not isinstance(MemoryIndex(16), FailOpenCounting)  # never fails open: no redis series


def test_every_label_is_bounded() -> None:
    metrics, _ = bridge_metrics()
    metrics.observe_turn("m", "toy", "stop", Usage(1, 0, 1), 0.1, 0.05)
    metrics.observe_rpc("primerl.v1.PrimeRL/Step", "OK", 0.1)
    metrics.fail_open.labels("redis").inc()
    names = {k for family in metrics.registry.collect() for s in family.samples for k in s.labels}
    assert names <= BOUNDED_LABELS


def test_every_metric_the_dashboard_queries_exists_in_the_registry() -> None:
    metrics, _ = bridge_metrics()
    known = exposed_names(metrics.registry)
    exprs = dashboard_exprs()
    assert exprs
    for title, expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"panel {title!r} queries no bridge metric: {expr}"
        missing = set(names) - known
        assert not missing, f"panel {title!r} queries unknown metrics {missing}"


def test_the_dashboard_covers_the_required_views() -> None:
    queried = {name for _, expr in dashboard_exprs() for name in METRIC.findall(expr)}
    required = {
        "primerl_generated_tokens_total",  # tokens/s
        "primerl_step_latency_seconds_bucket",  # p95 Step latency
        "primerl_cached_tokens_total",  # cache hit rate
        "primerl_prefix_index_hit_tokens_total",
        "primerl_kv_bytes",  # KV bytes
        "primerl_speculation_accepted_tokens_total",  # speculation acceptance
        "primerl_rpc_handled_total",  # errors
        "primerl_routing_decisions_total",  # routing decisions by reason
    }
    assert required <= queried
    exprs = " ".join(e for _, e in dashboard_exprs())
    assert "histogram_quantile(0.95, sum by (le, model) (rate(primerl_step_latency_seconds_bucket" in exprs


def test_the_dashboard_check_does_catch_an_unknown_metric() -> None:
    metrics, _ = bridge_metrics()
    known = exposed_names(metrics.registry)
    assert "primerl_generated_tokens_total" in known and "primerl_kv_bytes" in known
    assert "primerl_generated_tokens" not in known  # a counter is only queryable with _total
    assert "primerl_step_latency_seconds" not in known  # a histogram only as _bucket/_sum/_count


def test_every_alert_queries_existing_metrics_and_names_its_runbook_section() -> None:
    metrics, _ = bridge_metrics()
    known = exposed_names(metrics.registry)
    runbook = (ROOT / "docs" / "runbook.md").read_text().lower()
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 5
    for rule in rules:
        names = set(METRIC.findall(rule["expr"]))
        assert names and names <= known, (rule["alert"], names - known)
        anchor = rule["annotations"]["runbook"].split("#")[1]
        assert f"### {rule['alert'].lower()}" in runbook and anchor == rule["alert"].lower()


def test_histogram_quantile_matches_promql_interpolation() -> None:
    q = analyze_module().histogram_quantile
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert q(0.25, buckets) == pytest.approx(0.1)  # rank 10 = top of the first bucket
    assert q(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # rank 20 inside (0.1, 0.5]
    assert q(0.95, buckets) == pytest.approx(0.5 + 0.5 * (38 - 30) / 10)
    assert q(0.99, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # beyond the last finite bound
    assert math.isnan(q(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


def test_analyze_script_prints_totals_and_percentiles_of_a_dump(tmp_path: Path) -> None:
    metrics, _ = bridge_metrics()
    for i in range(100):  # latencies 10 ms .. 1 s; TTFT 5 ms
        metrics.observe_turn("m", "toy", "stop", Usage(10, 4, 5), (i + 1) / 100, 0.005)
    metrics.observe_turn("other", "vllm", "length", Usage(7, 0, 3), 2.0, 0.2)
    dump = tmp_path / "dump.txt"
    dump.write_bytes(generate_latest(metrics.registry))
    out = subprocess.run([sys.executable, str(SCRIPT), str(dump), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["models"]
    m = rows["m/toy"]
    assert (m["prompt"], m["cached"], m["generated"], m["turns"]) == (1000, 400, 500, 100)
    assert m["hit_ratio"] == pytest.approx(0.4)
    # p50: rank 50 lies in (0.25, 0.5], which holds observations 26..50 (cumulative 25 -> 50).
    assert m["step_latency_p50_s"] == pytest.approx(0.5)
    # p95: rank 95 in (0.5, 1.0] (cumulative 50 -> 100): 0.5 + 0.5 * 45 / 50.
    assert m["step_latency_p95_s"] == pytest.approx(0.95)
    assert m["ttft_p99_s"] == pytest.approx(0.0025 + 0.0025 * 0.99)  # all 100 in (0.0025, 0.005]
    assert rows["other/vllm"]["generated"] == 3 and rows["other/vllm"]["step_latency_count"] == 1
    assert LATENCY_BUCKETS[7:9] == (0.25, 0.5)  # the buckets the figures above assume

    table = subprocess.run([sys.executable, str(SCRIPT), str(dump)], capture_output=True, text=True).stdout
    assert "m/toy | 1000 | 400 | 500 | 100 | 0.400 | 500.0 ms | 950.0 ms" in table
