"""Every Prometheus metric of the bridge, declared once (business code calls these methods).

Invariants:
- one ``BridgeMetrics`` per bridge process (per ``BridgeServer`` in tests), each with its own
  ``CollectorRegistry``, so two bridges in one process never mix their numbers;
- labels are bounded: ``model``, ``engine`` and ``replica`` come from configuration,
  ``method`` from the service definition, ``code`` from ``grpc.StatusCode``, ``finish_reason``
  and ``source`` from small enums; never an episode id, tenant or prompt;
- values engines already count (``Engine.counters``) and state the bridge already holds
  (open episodes, policy version) are read at scrape time by ``BridgeCollector``: nothing is
  added to the hot path for them.

Engine-reported values read from ``EngineCounters.extra`` (an engine sets those it knows):
``kv_bytes`` (KV cache bytes held), ``kv_capacity_bytes`` (KV cache capacity),
``kv_usage_ppm`` (engine-reported KV usage in parts per million, for engines that report a
fraction), ``spec_drafted`` / ``spec_accepted`` (draft tokens the engine verified / accepted,
exported as ``primerl_speculation_{drafted,accepted}_tokens_total``). Any other key is exported
as ``primerl_engine_stat{name=...}``.

``primerl_fail_open_total{component}`` adds what the bridge counts itself
(``fail_open.labels(component).inc()``) to what components count on their own and the
collector reads at scrape time: the prefix index's ``stats.fail_open`` (a Redis index is
``component="redis"``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.types import EngineInfo, Usage
from engines.base import Engine

log = logging.getLogger("primerl.metrics")

# Step latency and TTFT: 1 ms .. 2 min, dense where interactive turns land (p50/p95/p99 via
# histogram_quantile).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
TOKENS_PER_S_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)

FAIL_OPEN_HELP = "Times a component failed and the bridge went on without it."
KNOWN_EXTRA = frozenset({"kv_bytes", "kv_capacity_bytes", "kv_usage_ppm", "spec_drafted", "spec_accepted"})


@runtime_checkable
class FailOpenCounting(Protocol):
    """A component that counts its own fail-opens (``cache.redis_index.RedisIndex``)."""

    fail_open_component: str  # the ``component`` label

    @property
    def stats(self) -> _FailOpenStats: ...


class _FailOpenStats(Protocol):
    @property
    def fail_open(self) -> int: ...


class RouterView(Protocol):
    @property
    def index(self) -> object | None:
        """The prefix index routing consults (None with one replica or the cache off)."""
        ...

    def decisions(self) -> Iterable[tuple[str, str, int]]:
        """(policy, reason, turns routed so far) per routing reason (``placement.routing.Router``)."""
        ...

    def predictions(self) -> Iterable[tuple[str, int]]:
        """(outcome, turns) of the prefix index's credit vs the engines' reports: exact, over, under."""
        ...

    def index_source(self, replica: int) -> str:
        """Where the prefix index learns what a replica holds: kv_events, learned or none."""
        ...

    def event_counts(self, replica: int) -> Iterable[tuple[str, int]]:
        """(kind, count so far) of the replica's KV events applied to the index (none without events)."""
        ...


class BridgeView(Protocol):
    """What the scrape-time collector reads from the bridge (``server.bridge.Bridge`` has it)."""

    @property
    def router(self) -> RouterView: ...

    @property
    def engines(self) -> Sequence[Engine]: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def store(self) -> Sized:
        """The open episodes."""
        ...


@dataclass(slots=True)
class _Totals:
    """Running sums kept next to the counters so ratios can be exported at scrape time."""

    prompt: int = 0
    cached: int = 0
    index_query: int = 0
    index_hit: int = 0


@dataclass(slots=True)
class _TurnChildren:
    """The labelled children one (model, engine) pair updates per turn."""

    prompt: Counter
    cached: Counter
    generated: Counter
    latency: Histogram
    ttft: Histogram
    decode_speed: Histogram
    totals: _Totals


class BridgeMetrics:
    """The bridge's metrics in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        me = ["model", "engine"]
        # Tokens, per model and engine (tokens/s = rate() of these).
        self.prompt_tokens = Counter(
            "primerl_prompt_tokens", "Tokens of history sent to the engine for a turn (prefill input).", me, registry=r
        )
        self.cached_tokens = Counter(
            "primerl_cached_tokens", "Prompt tokens the engine reported as served from its prefix/KV cache.", me,
            registry=r,
        )  # fmt: skip
        self.generated_tokens = Counter(
            "primerl_generated_tokens", "Tokens sampled by the engine (all turns, aborted ones too).", me, registry=r
        )
        self.turns = Counter(
            "primerl_turns", "Turns finished, by finish reason (stop, length, abort).", [*me, "finish_reason"],
            registry=r,
        )  # fmt: skip
        self.step_latency = Histogram(
            "primerl_step_latency_seconds", "Wall time of a turn, observation appended to last token.", me,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "primerl_ttft_seconds", "Time from the start of a turn to its first sampled token.", me,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_speed = Histogram(
            "primerl_decode_tokens_per_second", "Per-turn decode speed: generated tokens / (latency - TTFT).", me,
            buckets=TOKENS_PER_S_BUCKETS, registry=r,
        )  # fmt: skip
        # RPCs (filled by the server interceptor).
        self.rpc_handled = Counter(
            "primerl_rpc_handled", "RPCs completed, by method and gRPC status code.", ["method", "code"], registry=r
        )
        self.rpc_duration = Histogram(
            "primerl_rpc_duration_seconds", "RPC wall time by method.", ["method"], buckets=LATENCY_BUCKETS, registry=r
        )
        # Prefix cache of the bridge's own index (cache/ increments these).
        self.index_query_tokens = Counter(
            "primerl_prefix_index_query_tokens", "Prompt tokens looked up in the bridge's prefix index.", ["model"],
            registry=r,
        )  # fmt: skip
        self.index_hit_tokens = Counter(
            "primerl_prefix_index_hit_tokens", "Prompt tokens found in the bridge's prefix index.", ["model"],
            registry=r,
        )  # fmt: skip
        # Not registered: ``FailOpenCollector`` exports it together with the components' own counts.
        self.fail_open = Counter("primerl_fail_open", FAIL_OPEN_HELP, ["component"], registry=None)
        self._fail_open_sources: list[Callable[[], Iterable[tuple[str, int]]]] = []
        r.register(FailOpenCollector(self))
        self.staleness_rejections = Counter(
            "primerl_staleness_rejections", "Requests refused because their policy version was too stale.", ["model"],
            registry=r,
        )  # fmt: skip
        # The HTTP front door (server/http): requests by route and status, and append-only breaks.
        self.http_requests = Counter(
            "primerl_http_requests", "HTTP front-door requests, by route and HTTP status.", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.http_duration = Histogram(
            "primerl_http_duration_seconds", "HTTP front-door request wall time by route.", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.http_forks = Counter(
            "primerl_http_forks",
            "HTTP session calls whose history did not extend the session's (a new branch was started).",
            ["route"],
            registry=r,
        )
        # Weight updates by phase (server/weights.py): prepare, drain, apply, verify, rollback, pause (apply + verify +
        # rollback: no replica generates), held (new turns wait: drain + pause), total (the call).
        self.weight_update_seconds = Histogram(
            "primerl_weight_update_seconds", "Weight update wall time by phase (pause: no generation).", ["phase"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._children: dict[tuple[str, str], _TurnChildren] = {}
        self._finished: dict[tuple[str, str, str], Counter] = {}  # (model, engine, finish reason) -> turns child
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}  # (method, code) -> children
        self._index_totals: dict[str, _Totals] = {}
        self.engine_health: dict[str, bool] = {}

    def weight_update_phase(self, phase: str, seconds: float) -> None:
        self.weight_update_seconds.labels(phase).observe(seconds)

    # -- hot path -----------------------------------------------------------------------

    def observe_turn(
        self, model: str, engine: str, finish_reason: str, usage: Usage, latency_s: float, ttft_s: float
    ) -> None:
        """Record a finished turn (called once per turn, also for aborted ones)."""
        c = self._children.get((model, engine))
        if c is None:  # label lookups cost ~1.5 us each: resolve them once per (model, engine)
            c = self._children[(model, engine)] = _TurnChildren(
                self.prompt_tokens.labels(model, engine),
                self.cached_tokens.labels(model, engine),
                self.generated_tokens.labels(model, engine),
                self.step_latency.labels(model, engine),
                self.ttft.labels(model, engine),
                self.decode_speed.labels(model, engine),
                _Totals(),
            )
        c.prompt.inc(usage.prompt_tokens)
        c.cached.inc(usage.cached_tokens)
        c.generated.inc(usage.generated_tokens)
        if (finished := self._finished.get((model, engine, finish_reason))) is None:
            finished = self._finished[(model, engine, finish_reason)] = self.turns.labels(model, engine, finish_reason)
        finished.inc()
        c.latency.observe(latency_s)
        if usage.generated_tokens:
            c.ttft.observe(ttft_s)
            decode_s = latency_s - ttft_s
            if usage.generated_tokens > 1 and decode_s > 0:
                c.decode_speed.observe((usage.generated_tokens - 1) / decode_s)
        c.totals.prompt += usage.prompt_tokens
        c.totals.cached += usage.cached_tokens

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        children = self._rpc_children.get((method, code))
        if children is None:  # resolved once per (method, code): both label sets are bounded
            children = self._rpc_children[(method, code)] = (
                self.rpc_handled.labels(method, code),
                self.rpc_duration.labels(method),
            )
        children[0].inc()
        children[1].observe(seconds)

    def observe_index_lookup(self, model: str, query_tokens: int, hit_tokens: int) -> None:
        """The bridge's prefix index looked up ``query_tokens`` and found ``hit_tokens`` of them."""
        self.index_query_tokens.labels(model).inc(query_tokens)
        self.index_hit_tokens.labels(model).inc(hit_tokens)
        t = self._index_totals.setdefault(model, _Totals())
        t.index_query += query_tokens
        t.index_hit += hit_tokens

    # -- scrape time --------------------------------------------------------------------

    def attach(self, bridge: BridgeView) -> None:
        """Export the bridge's and its engines' state, read at each scrape."""
        self.registry.register(BridgeCollector(bridge, self))
        self.watch_fail_open(lambda: _index_fail_open(bridge.router.index))

    def watch_fail_open(self, read: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Export fail-opens a component counts itself: ``read()`` -> (component, count so far) pairs."""
        self._fail_open_sources.append(read)

    def fail_open_counts(self) -> dict[str, float]:
        """Fail-opens so far by component: the bridge's own plus the watched components' counts."""
        counts: dict[str, float] = {}
        for family in self.fail_open.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[s.labels["component"]] = counts.get(s.labels["component"], 0.0) + s.value
        for read in self._fail_open_sources:
            for component, n in read():
                counts[component] = counts.get(component, 0.0) + n
        return counts

    def hit_ratios(self) -> Iterator[tuple[str, str, str, float]]:
        """(model, engine, source, lifetime hit ratio) for every series that has data."""
        for (model, engine), c in list(self._children.items()):
            if (t := c.totals).prompt:
                yield model, engine, "engine", t.cached / t.prompt
        for model, t in list(self._index_totals.items()):
            if t.index_query:
                yield model, "", "index", t.index_hit / t.index_query


class BridgeCollector(Collector):
    """Scrape-time view of open episodes, policy version, hit ratios and engine counters."""

    def __init__(self, bridge: BridgeView, metrics: BridgeMetrics) -> None:
        self.bridge = bridge
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        f = _Families()
        b = self.bridge
        model = b.info.model
        f.active.add_metric([model], len(b.store))
        f.version.add_metric([model], b.policy_version)
        for policy, reason, n in b.router.decisions():  # counted by the policy as it decides: no hot-path cost
            f.routing.add_metric([model, policy, reason], n)
        for outcome, n in b.router.predictions():
            f.predictions.add_metric([model, outcome], n)
        for m, engine, source, value in self.metrics.hit_ratios():
            f.hit_ratio.add_metric([m, engine, source], value)
        for r, e in enumerate(b.engines):
            c, info = e.counters, e.info
            labels = [info.engine, info.replica]
            f.index_source.add_metric([*labels, b.router.index_source(r)], 1.0)
            for kind, n in b.router.event_counts(r):
                f.kv_events.add_metric([*labels, kind], n)
            f.prefill.add_metric(labels, c.prefill_tokens)
            f.cached.add_metric(labels, c.cached_tokens)
            f.generated.add_metric(labels, c.generated_tokens)
            f.passes.add_metric(labels, c.forward_passes)
            f.requests.add_metric(labels, c.requests)
            extra = dict(c.extra)
            if "spec_drafted" in extra:
                f.spec_drafted.add_metric([model, *labels], extra["spec_drafted"])
                f.spec_accepted.add_metric([model, *labels], extra.get("spec_accepted", 0))
            if "kv_bytes" in extra:
                f.kv_bytes.add_metric(labels, extra["kv_bytes"])
            if "kv_usage_ppm" in extra:
                f.kv_usage.add_metric(labels, extra["kv_usage_ppm"] / 1e6)
            elif extra.get("kv_capacity_bytes") and "kv_bytes" in extra:
                f.kv_usage.add_metric(labels, extra["kv_bytes"] / extra["kv_capacity_bytes"])
            if (h := self.metrics.engine_health.get(info.replica)) is not None:
                f.healthy.add_metric(labels, 1.0 if h else 0.0)
            for name in sorted(extra.keys() - KNOWN_EXTRA):
                f.stat.add_metric([*labels, name], extra[name])
        return f.all()


def _index_fail_open(index: object | None) -> Iterator[tuple[str, int]]:
    if isinstance(index, FailOpenCounting):
        yield index.fail_open_component, index.stats.fail_open


class FailOpenCollector(Collector):
    """``primerl_fail_open_total{component}``, read at scrape time (see ``BridgeMetrics.fail_open_counts``)."""

    def __init__(self, metrics: BridgeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily("primerl_fail_open", FAIL_OPEN_HELP, labels=["component"])]

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("primerl_fail_open", FAIL_OPEN_HELP, labels=["component"])
        for component, n in sorted(self.metrics.fail_open_counts().items()):
            family.add_metric([component], n)
        return [family]


class _Families:
    """The metric families ``BridgeCollector`` exports (fresh ones per scrape)."""

    def __init__(self) -> None:
        er = ["engine", "replica"]
        self.active = GaugeMetricFamily("primerl_active_episodes", "Open episodes on this bridge.", labels=["model"])
        self.version = GaugeMetricFamily(
            "primerl_policy_version", "Newest policy version loaded by the engines.", labels=["model"]
        )
        self.hit_ratio = GaugeMetricFamily(
            "primerl_prefix_cache_hit_ratio",
            "Lifetime prefix-cache hit ratio in tokens; source=engine: engine-reported cached/prompt tokens, "
            "source=index: the bridge's prefix index.",
            labels=["model", "engine", "source"],
        )
        self.prefill = CounterMetricFamily(
            "primerl_engine_prefill_tokens", "Prefill tokens the engine reports.", labels=er
        )
        self.cached = CounterMetricFamily(
            "primerl_engine_cached_tokens", "Cached prompt tokens the engine reports.", labels=er
        )
        self.generated = CounterMetricFamily(
            "primerl_engine_generated_tokens", "Tokens the engine reports generating.", labels=er
        )
        self.passes = CounterMetricFamily(
            "primerl_engine_forward_passes", "Forward passes the engine reports.", labels=er
        )
        self.requests = CounterMetricFamily("primerl_engine_requests", "Generate calls the engine received.", labels=er)
        self.kv_bytes = GaugeMetricFamily(
            "primerl_kv_bytes", "KV cache bytes held by the engine (embedded engine).", labels=er
        )
        self.kv_usage = GaugeMetricFamily(
            "primerl_engine_kv_usage_ratio", "Engine-reported KV cache usage (0..1).", labels=er
        )
        mer = ["model", *er]
        self.spec_drafted = CounterMetricFamily(
            "primerl_speculation_drafted_tokens", "Draft tokens the engine verified (speculation).", labels=mer
        )
        self.spec_accepted = CounterMetricFamily(
            "primerl_speculation_accepted_tokens", "Draft tokens the engine accepted by exact verification.",
            labels=mer,
        )  # fmt: skip
        self.routing = CounterMetricFamily(
            "primerl_routing_decisions",
            "Turns routed, by policy and reason (rr, load, sticky, group, ring, cache, shed, fail_open, "
            "fallback_sticky: cache_aware running sticky without a prefix index).",
            labels=["model", "policy", "reason"],
        )
        self.healthy = GaugeMetricFamily("primerl_engine_healthy", "1 if the last health check passed.", labels=er)
        self.predictions = CounterMetricFamily(
            "primerl_routing_predictions",
            "Turns whose prefix the index credited to the chosen replica, against the engine's cached-token report "
            "(block granularity; a prompt's last token never counts): exact, over (credited KV it no longer had), "
            "under.",
            labels=["model", "outcome"],
        )
        self.index_source = GaugeMetricFamily(
            "primerl_prefix_index_source",
            "1 for where the prefix index learns what the replica holds: kv_events (the engine's own KV events: "
            "exact), learned (routed turns and cached-token reports), none (no index).",
            labels=[*er, "source"],
        )
        self.kv_events = CounterMetricFamily(
            "primerl_kv_events",
            "The replica's KV events applied to the prefix index: stored and removed blocks, cleared caches, "
            "resyncs (lost batches), restarts, unmapped blocks (unknown salt or parent), batches, turns.",
            labels=[*er, "kind"],
        )
        self.stat = GaugeMetricFamily("primerl_engine_stat", "Other engine-reported values.", labels=[*er, "name"])

    def all(self) -> list[Metric]:
        return list(vars(self).values())


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry can expose (``_total``, ``_bucket``... included)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("", "_sum", "_count", "_created"),
    }
    names: set[str] = set()
    for family in registry.collect():  # families are listed even before they have samples
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


@dataclass
class MetricsEndpoint:
    """The ``/metrics`` HTTP listener (a daemon thread of prometheus_client)."""

    registry: CollectorRegistry
    host: str
    port: int
    _server: WSGIServer | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> int:
        """Bind and serve; returns the bound port. Raises OSError if the port is taken."""
        addr = "0.0.0.0" if self.host in ("", "[::]", "::") else self.host
        try:
            self._server, self._thread = start_http_server(self.port, addr, self.registry)
        except OSError as exc:
            raise OSError(f"cannot bind the metrics port {addr}:{self.port}: {exc.strerror or exc}") from exc
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
