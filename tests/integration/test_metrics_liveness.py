"""Every series the Grafana dashboard and the alert rules query is produced by a real bridge.

A toy bridge with two replicas, a private Redis for its prefix index, speculation on and a
staleness bound is driven through the scenarios an operator watches for: speculative tool-call
turns, each routing reason of the cache-aware policy (new episode, sticky turn, prefix-cache hit,
GRPO group, shed from a hot replica, Redis down), a stale episode refused, admission refusing work,
a replica failing a turn, and Redis killed. Then ``/metrics`` is scraped over HTTP and every series
named in ``k8s/HelmChart/dashboards/grafana.json`` and in every expression of
``k8s/HelmChart/files/alerts.yml`` must have at least one sample that its label matchers select.
Three more toy bridges (round_robin, consistent_hash, and cache_aware without an index) produce
the remaining routing reasons, so ``primerl_routing_decisions_total`` is seen with every reason.

The toy engine holds no KV cache; its replicas here report ``kv_bytes`` / ``kv_capacity_bytes`` in
their counters as engines with a KV cache do (the embedded engine's ``KVStore`` sets both keys;
vLLM and SGLang report ``kv_usage_ppm``), which is what the KV panels and alert read.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.errors import EngineUnavailable
from core.types import EngineCounters, GenerateRequest, TokenChunk
from engines.config import ToyConfig
from engines.embedded.kvcache import KVStore
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient
from rl_client.errors import FailedPreconditionError, ResourceExhaustedError, UnavailableError
from server.app import BridgeServer, create_server
from server.config import load_settings
from tests.conftest import StartBridge
from tests.integration.redis_proc import PrivateRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "HelmChart" / "dashboards" / "grafana.json"
ALERTS = ROOT / "k8s" / "HelmChart" / "files" / "alerts.yml"
PREFIXES = ("primerl_",)  # the bridge's own series (a dashboard may also query engines' vllm:... ones)
# A series name in PromQL: an identifier followed by a label matcher, a range, whitespace, ")" or the end
# (a function name is followed by "(", a label name inside "by (...)" never has the prefix).
SERIES = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)(?=\s*(?:\{|\[|\)|\s|$))")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
REASONS = {"rr", "load", "sticky", "group", "ring", "cache", "shed", "fail_open", "fallback_sticky"}
KV_CAPACITY = 1 << 20
KV_BYTES_PER_TOKEN = 1024
TOOL = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@dataclass(frozen=True)
class Selector:
    """One series a query reads: its sample name and the label matchers applied to it."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]
    source: str  # the panel or alert that queries it

    @property
    def family(self) -> str:
        for suffix in SUFFIXES:
            if self.name.endswith(suffix):
                return self.name[: -len(suffix)]
        return self.name

    def selects(self, labels: dict[str, str]) -> bool:
        for label, op, value in self.matchers:
            got = labels.get(label, "")
            full = re.fullmatch(value, got) is not None
            if (op == "=" and got != value) or (op == "!=" and got == value):
                return False
            if (op == "=~" and not full) or (op == "!~" and full):
                return False
        return True

    def __str__(self) -> str:
        labels = ",".join(f'{k}{op}"{v}"' for k, op, v in self.matchers)
        return f"{self.name}{{{labels}}} (family {self.family}; {self.source})"


def selectors(expr: str, source: str) -> list[Selector]:
    """The bridge series an expression reads, with the label matchers written right after each name."""
    out = []
    for m in SERIES.finditer(expr):
        name = m.group(1)
        if not name.startswith(PREFIXES):
            continue
        rest = expr[m.end() :].lstrip()
        matchers: tuple[tuple[str, str, str], ...] = ()
        if rest.startswith("{"):
            matchers = tuple(MATCHER.findall(rest[1 : rest.index("}")]))
        out.append(Selector(name, matchers, source))
    return out


def queried() -> list[Selector]:
    """Every series the dashboard's panels and the alert rules read."""
    dash = json.loads(DASHBOARD.read_text())
    found = [
        s for p in dash["panels"] for t in p.get("targets", []) for s in selectors(t["expr"], f"panel {p['title']!r}")
    ]
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    found += [s for r in rules for s in selectors(r["expr"], f"alert {r['alert']}")]
    return found


Samples = list[tuple[str, dict[str, str], float]]


def parse(text: str) -> Samples:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def missing(samples: Samples, wanted: Iterable[Selector]) -> list[str]:
    return [str(w) for w in wanted if not any(n == w.name and w.selects(ls) for n, ls, _ in samples)]


class KVToy(ToyEngine):
    """The toy model reporting KV bytes held (the tokens of the episodes it served) out of a capacity.

    ``fail_next`` makes its next generate call fail as an unreachable replica does.
    """

    def __init__(self, config: ToyConfig, replica: str) -> None:
        super().__init__(config, replica=replica)
        self.held: dict[str, int] = {}
        self.fail_next = False
        self.counters.extra.update(kv_bytes=0, kv_capacity_bytes=KV_CAPACITY)

    def _report(self) -> None:
        self.counters.extra["kv_bytes"] = sum(self.held.values()) * KV_BYTES_PER_TOKEN

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        if self.fail_next:
            self.fail_next = False
            raise EngineUnavailable(f"replica {self.info.replica} is unreachable")
        self.held[request.episode_id] = len(request.token_ids)
        self._report()
        async for chunk in super().generate(request):
            yield chunk

    async def release(self, episode_id: str) -> None:
        self.held.pop(episode_id, None)
        self._report()
        await super().release(episode_id)


async def scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    return await asyncio.to_thread(get)


@pytest.fixture
async def main_bridge(redis_server: PrivateRedis) -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient]]:
    toy = ToyConfig(token_delay_s=0.002)
    engines = [KVToy(toy, "toy-0"), KVToy(toy, "toy-1")]
    settings = load_settings(
        server={"port": 0, "grace_period_s": 1.0},
        metrics={"port": free_port(), "health_interval_s": 0.5},
        engine={"type": "toy", "replicas": 2},
        redis={"url": redis_server.url},
        # Any in-flight gap makes a replica hot, so a turn pinned to a busy replica is shed.
        routing={"policy": "cache_aware", "balance_abs_tokens": 0, "balance_rel": 1.0},
        speculation={"enabled": True, "drafters": ["grammar", "ngram"]},
        admission={"max_staleness": 1, "max_episodes": 24},
    )
    async with AsyncExitStack() as stack:
        server = await create_server(settings, engines)
        await server.start()
        stack.push_async_callback(server.stop, 0.5)
        client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30)
        stack.push_async_callback(client.close)
        yield server, client


async def drive(server: BridgeServer, client: AsyncBridgeClient, redis_server: PrivateRedis) -> None:
    short = {"max_tokens": 6, "ignore_eos": True, "seed": 1}
    # Speculation: an episode with a tool, decoded greedily; the toy's greedy output falls into a cycle
    # that the n-gram drafter then predicts, so drafts are verified and some accepted.
    prompt = [7, 8, 9, 10] * 12
    greedy = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
    ep = (await client.start_episode(prompt, tools=[TOOL], sampling=greedy)).episode_id
    for _ in range(4):
        await client.step(ep)  # routing: load (the first), then sticky
    await client.end_episode(ep, reward=1.0)
    # A prefix-cache hit: the same prompt again goes where its blocks are (once the index has them:
    # its writes run in the background).
    index = server.bridge.router.index
    assert index is not None
    await index.flush()
    ep = (await client.start_episode(prompt, sampling=short)).episode_id
    await client.step(ep)
    await client.discard_episode(ep)
    # A GRPO group: every member on the group's replica.
    group = (await client.start_episode(list(range(100, 140)), group_size=2, sampling=short)).episode_ids
    for member in group:
        await client.step(member)
        await client.end_episode(member)
    await shed(server, client)
    # A replica fails a turn (UNAVAILABLE, a server-side error the error-rate alert counts); the health
    # check puts it back in rotation.
    started = await client.start_episode([3, 4, 5], sampling=short)
    replica = next(e for e in server.bridge.engines if e.info.replica == started.replica)
    assert isinstance(replica, KVToy)
    replica.fail_next = True
    with pytest.raises(UnavailableError):
        await client.step(started.episode_id)
    await server.check_health()
    # Staleness: started at version 0, two versions behind after an update (bound 1).
    stale = (await client.start_episode([3, 4, 5], sampling=short)).episode_id
    assert await client.update_weights(policy_version=2) == 2
    with pytest.raises(FailedPreconditionError):
        await client.step(stale)
    # Admission: more open episodes than admission.max_episodes.
    with pytest.raises(ResourceExhaustedError):
        for i in range(30):
            await client.start_episode([3, 4, 5, i], sampling=short)
    for episode_id in list(server.bridge.store._episodes):
        await client.discard_episode(episode_id)
    # Redis killed: routing fails open to load-only and the turn still completes.
    redis_server.kill()
    ep = (await client.start_episode(list(range(200, 240)), sampling=short)).episode_id
    await client.step(ep)
    await client.end_episode(ep)


async def shed(server: BridgeServer, client: AsyncBridgeClient) -> None:
    """Two episodes pinned to one replica; while one runs a long turn, the other's turn is shed elsewhere."""
    short = {"max_tokens": 4, "ignore_eos": True}
    by_replica: dict[str, list[str]] = {}
    for i in range(4):
        started = await client.start_episode([20 + i, 21, 22, 23], sampling=short)
        by_replica.setdefault(started.replica, []).append(started.episode_id)
    busy, pinned = next(eps for eps in by_replica.values() if len(eps) >= 2)[:2]
    chunks = client.stream_step(busy, sampling={"max_tokens": 400, "ignore_eos": True})
    await anext(chunks)  # the long turn is in flight: its replica is hot
    await client.step(pinned)
    async for _ in chunks:
        pass
    for eps in by_replica.values():
        for ep in eps:
            await client.end_episode(ep)


async def other_policies(start_bridge: StartBridge) -> Samples:
    """Bridges running round_robin, consistent_hash, and cache_aware without an index (sticky fallback)."""
    samples: Samples = []
    for routing, cache in (("round_robin", True), ("consistent_hash", True), ("cache_aware", False)):
        server, client = await start_bridge(
            engine={"replicas": 2}, routing={"policy": routing}, cache={"enabled": cache}
        )
        ep = (await client.start_episode([1, 4, 30, 31, 32], sampling={"max_tokens": 4})).episode_id
        await client.step(ep)
        await client.step(ep, [2, 5])
        samples += parse(generate_latest(server.metrics.registry).decode())
    return samples


async def test_every_dashboard_and_alert_series_has_samples(
    main_bridge: tuple[BridgeServer, AsyncBridgeClient], redis_server: PrivateRedis, start_bridge: StartBridge
) -> None:
    server, client = main_bridge
    wanted = queried()
    assert len({w.name for w in wanted}) >= 20, "the dashboard/alert parser found too few series"
    await drive(server, client, redis_server)
    await server.check_health()  # the engine health gauge after the weight update

    samples = parse(await scrape(server.metrics_port))
    dead = missing(samples, wanted)
    assert not dead, "series queried by the dashboard or an alert with no sample:\n  " + "\n  ".join(dead)

    def value(name: str, **labels: str) -> float:
        return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())

    assert 0 < value("primerl_speculation_accepted_tokens_total") <= value("primerl_speculation_drafted_tokens_total")
    assert value("primerl_fail_open_total", component="redis") > 0
    assert value("primerl_staleness_rejections_total", model="toy") == 1

    reasons = {
        ls["reason"]
        for n, ls, _ in samples + await other_policies(start_bridge)
        if n.startswith("primerl_routing_decisions") and "reason" in ls
    }
    assert reasons >= REASONS, f"routing reasons never exported: {sorted(REASONS - reasons)}"


def test_the_parser_reads_names_suffixes_and_matchers() -> None:
    found = selectors(
        "histogram_quantile(0.95, sum by (le, model) (rate(primerl_step_latency_seconds_bucket[5m]))) > 10 "
        'and sum(rate(primerl_rpc_handled_total{code=~"INTERNAL|UNKNOWN", method!="x"}[5m])) / '
        "sum by (replica) (primerl_kv_bytes)",
        "test",
    )
    assert [(s.name, s.family) for s in found] == [
        ("primerl_step_latency_seconds_bucket", "primerl_step_latency_seconds"),
        ("primerl_rpc_handled_total", "primerl_rpc_handled"),
        ("primerl_kv_bytes", "primerl_kv_bytes"),
    ]
    errors = found[1]
    assert errors.matchers == (("code", "=~", "INTERNAL|UNKNOWN"), ("method", "!=", "x"))
    assert errors.selects({"code": "UNKNOWN", "method": "m"})
    assert not errors.selects({"code": "OK", "method": "m"}) and not errors.selects({"code": "UNKNOWN", "method": "x"})
    samples: Samples = [("primerl_rpc_handled_total", {"code": "OK", "method": "m"}, 3.0)]
    assert missing(samples, found) == [str(s) for s in found]  # a matcher that selects nothing is missing


def test_the_embedded_kv_store_reports_its_capacity() -> None:
    counters = EngineCounters()
    KVStore(4096, counters)
    assert counters.extra["kv_capacity_bytes"] == 4096  # with kv_bytes: primerl_engine_kv_usage_ratio
