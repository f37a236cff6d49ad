"""Server assembly and lifecycle: ``create_server`` builds a ready-to-start bridge.

Shutdown order (``BridgeServer.stop``): health NOT_SERVING -> stop accepting RPCs -> drain in-flight
Steps for the grace period -> stop the HTTP front door (its in-flight calls drain for the grace period)
-> close open episodes' environments -> close engines -> stop /metrics and flush traces.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engines import Engine, make_engines
from observability.metrics import BridgeMetrics, MetricsEndpoint
from observability.tracing import Tracing
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from server.auth import AuthInterceptor, load_tenants, server_credentials
from server.bridge import Bridge
from server.config import Settings
from server.errors import InvalidArgument, PrimeRLError
from server.fleet.member import join_fleet
from server.fleet.router import FleetOwnerInterceptor
from server.fleet.workers import WorkerSlot
from server.http import HttpFrontDoor, create_app
from server.inspector import EndedStore, EpisodeLog, InspectorConfig
from server.persistence import EpisodeJournal
from server.service import PrimeRLService
from server.telemetry import TelemetryInterceptor

log = logging.getLogger("primerl.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrimeRL"].full_name
STUCK_EXIT_S = 30.0  # serve(): a shutdown this long past the grace period exits the process
SETTLE_S = 5.0  # stop(): how long cancelled Steps get to write their episodes back and unlease them


@dataclass
class BridgeServer:
    server: grpc.aio.Server
    port: int
    bridge: Bridge
    health: HealthServicer
    settings: Settings
    tracing: Tracing = field(default_factory=lambda: Tracing(None))
    metrics_endpoint: MetricsEndpoint | None = None
    http: HttpFrontDoor | None = None  # the HTTP front door (None when http.port = 0)
    _health_poll: asyncio.Task[None] | None = None
    _serving: bool | None = None
    _stopping: bool = False
    stop_phase: str = "serving"  # what stop() is doing (named in the log if a shutdown hangs)

    @property
    def metrics(self) -> BridgeMetrics:
        return self.bridge.metrics

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port (0 when the endpoint is off)."""
        return self.metrics_endpoint.port if self.metrics_endpoint is not None else 0

    @property
    def http_port(self) -> int:
        """The bound HTTP front-door port (0 when it is off)."""
        return self.http.port if self.http is not None else 0

    @property
    def address(self) -> str:
        return f"{self.settings.server.host}:{self.port}"

    async def start(self) -> None:
        if self.metrics_endpoint is not None:
            port = self.metrics_endpoint.start()
            log.info("Prometheus metrics on %s:%d/metrics", self.metrics_endpoint.host, port)
        await self.bridge.start()
        # Until the first health check has answered (a remote engine can take seconds): NOT_SERVING. Otherwise
        # the server ("") would be SERVING (grpc's default) and primerl.v1.PrimeRL NOT_FOUND meanwhile.
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        await self.check_health()
        self._health_poll = asyncio.create_task(self._supervise_health(), name="engine-health-supervisor")

    async def _supervise_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.metrics.health_interval_s)
            await self.check_health()

    async def check_health(self) -> bool:
        """Check every replica: the health gauge, its place in routing, and the gRPC health status.

        A replica is in rotation when its health check passes and it serves the newest policy version's weights:
        one that was out, or missed a weight update, is first checked, reloaded where needed, and proven
        (``Weights.rejoin``). The bridge is SERVING while any replica is in rotation; engines that come up after
        the bridge are picked up at the next check.
        """
        bridge = self.bridge
        newest = bridge.policy_version
        timeout = self.settings.metrics.health_interval_s
        any_ok = False
        for i, engine in enumerate(bridge.engines):
            try:
                async with asyncio.timeout(timeout):
                    result = await engine.health()
                ok, detail = result.healthy, result.detail
            except TimeoutError:
                ok, detail = False, f"health check took longer than {timeout:.0f} s"
            except Exception as exc:  # noqa: BLE001 - whatever a health call raises, the replica is unhealthy
                ok, detail = False, f"health check failed: {exc}"
            bridge.metrics.engine_health[engine.info.replica] = ok
            behind = engine.policy_version < newest
            if ok and (behind or not bridge.router.replicas.healthy[i]) and i not in bridge.replicas.withdrawn:
                try:  # back in rotation only on the committed weights, with every committed LoRA adapter
                    detail = await bridge.weights.rejoin(i) or await bridge.adapters.restore(i)
                except Exception as exc:  # noqa: BLE001 - the health loop must outlive whatever a rejoin raises
                    detail = f"could not check its weights: {exc}"
                ok = not detail
            elif ok and behind:
                ok, detail = False, f"serves policy version {engine.policy_version}, not {newest}"
            bridge.mark_replica(i, ok, detail)
            any_ok |= ok
        if not self._stopping and any_ok != self._serving:
            status = health_pb2.HealthCheckResponse.SERVING if any_ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            if not any_ok:
                log.error("no engine replica is healthy: reporting NOT_SERVING")
            elif self._serving is False:
                log.info("an engine replica is healthy again: reporting SERVING")
            self._serving = any_ok
        return any_ok

    async def stop(self, grace: float | None = None) -> None:
        grace = self.settings.server.grace_period_s if grace is None else grace
        self._stopping = True
        self.stop_phase = "draining in-flight RPCs"
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.stop_phase = "settling cancelled Steps"
        await self._settle()
        self.bridge.inspector.close()  # end the live pages' streams: the front door stops without waiting on them
        if self.http is not None:
            self.stop_phase = "stopping the HTTP front door"
            await self.http.stop()
        self.stop_phase = "stopping the health supervisor"
        if self._health_poll is not None:  # before the engines close, so it never checks a closed one
            self._health_poll.cancel()
            await asyncio.gather(self._health_poll, return_exceptions=True)
            self._health_poll = None
        self.stop_phase = "closing environments and the routing index"
        await self.bridge.close()  # environments of episodes still open
        self.stop_phase = "closing engines"
        for engine in self.bridge.engines:
            await engine.close()
        self.stop_phase = "closing the episode journal"
        await self.bridge.inspector.close_store()  # ended episodes still queued for Redis, before its client closes
        if self.bridge.journal is not None:  # open episodes stay in Redis for the next bridge
            await self.bridge.journal.close()
        self.stop_phase = "stopping metrics and tracing"
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        self.tracing.shutdown()
        self.stop_phase = "exiting the process"

    async def _settle(self) -> None:
        """Before the journal closes: let the Steps that stop() cancelled finish their cleanup (write the episode
        back, release its Step lease). Cut short, a lease would stay in Redis and the episode's next Step or end,
        through the next bridge, would be refused as busy until the lease expired."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while self.bridge.inflight or self.bridge.episodes.leases_held:
            if loop.time() >= deadline:
                log.warning(
                    "%d Step lease(s) still held after %.0f s: they expire on their own",
                    self.bridge.episodes.leases_held,
                    SETTLE_S,
                )
                return
            await asyncio.sleep(0.01)


async def _drop_leases(journal: EpisodeJournal, worker: WorkerSlot) -> None:
    """A worker replacing crashed ones: drop the Step leases the dead processes held (their episodes' next Steps
    would otherwise be refused as busy until the leases expire)."""
    try:
        dropped = await journal.break_leases_of(worker.predecessors)
    except PrimeRLError as exc:
        log.warning(
            "could not drop the Step leases of crashed worker %d: %s (they expire on their own)",
            worker.index,
            exc.message,
        )
        return
    log.info("dropped %d Step lease(s) that crashed worker %d held", dropped, worker.index)


def _interceptors(
    settings: Settings,
    tenants: dict[str, str],
    telemetry: TelemetryInterceptor,
    worker: WorkerSlot | None,
    fleet_routing: FleetOwnerInterceptor | None,
) -> list[grpc.aio.ServerInterceptor]:
    """The bridge's interceptors, outermost first."""
    interceptors: list[grpc.aio.ServerInterceptor] = [telemetry]
    if tenants:  # outermost is telemetry, so refused calls are counted too
        interceptors.append(AuthInterceptor(tenants, settings.auth.admin_tenants))
        log.info("authentication on: %d token(s), admin tenants %s", len(tenants), settings.auth.admin_tenants)
    else:
        log.info("authentication off: any client may call the bridge (configure auth.* to require tokens)")
    if worker is not None:  # innermost: a forwarded call is authenticated here and again by its owner
        interceptors.append(worker.interceptor(settings.persistence.enabled))
    if fleet_routing is not None:  # innermost too: a Step for another bridge's episode goes to that bridge
        interceptors.append(fleet_routing)
    return interceptors


def _ended_store(journal: EpisodeJournal | None, config: InspectorConfig) -> EndedStore | None:
    """With persistence on, the inspector keeps ended episodes in the journal's Redis too."""
    if journal is None or not config.enabled:
        return None
    return EndedStore.for_journal(journal, config.ended_ttl_s, config.max_ended_episodes)


async def create_server(
    settings: Settings,
    engines: Sequence[Engine] | None = None,
    *,
    tracing: Tracing | None = None,
    worker: WorkerSlot | None = None,
) -> BridgeServer:
    """Build the bridge (engines started, port bound, not yet serving).

    ``tracing`` defaults to what the ``OTEL_*`` variables ask for (off when they ask nothing). ``worker``:
    this process is one of ``primerl serve --workers N`` (server.fleet.workers): the port is shared, a private
    address is bound too, and calls for another worker's episodes are forwarded to it.
    """
    tracing = tracing if tracing is not None else Tracing.from_env()
    journal = None
    if settings.persistence.enabled:
        if not settings.redis.url:
            raise InvalidArgument("persistence.enabled needs redis.url (the Redis that keeps the episodes)")
        journal = EpisodeJournal(settings.redis.url, settings.persistence, worker.lease_owner if worker else "")
        log.info("episode persistence on: %s (prefix %r)", settings.redis.url, settings.persistence.key_prefix)
        if worker is not None and worker.predecessors:
            await _drop_leases(journal, worker)
    engines = list(engines) if engines is not None else await make_engines(settings.engine)
    metrics = BridgeMetrics()
    bridge = Bridge(
        [tracing.wrap(e) for e in engines],
        settings.admission,
        settings.sampling,
        metrics,
        settings.envhub,
        journal,
        cache=settings.cache,
        routing=settings.routing,
        redis_url=settings.redis.url,
        speculation=settings.speculation,
        inspector=EpisodeLog(settings.inspector, _ended_store(journal, settings.inspector)),
    )
    metrics.attach(bridge)
    limit = settings.server.max_message_bytes
    tenants = load_tenants(settings.auth)
    credentials = server_credentials(settings.tls)
    fleet_routing = FleetOwnerInterceptor(bridge, settings.persistence.enabled) if settings.fleet.enabled else None
    interceptors = _interceptors(settings, tenants, TelemetryInterceptor(metrics, tracing), worker, fleet_routing)
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    options += worker.server_options() if worker is not None else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_PrimeRLServicer_to_server(PrimeRLService(bridge, settings.server.stream_interval_ms), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    address = f"{settings.server.host}:{settings.server.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {settings.server.host}:{settings.server.port}")
    if worker is not None:
        worker.attach(server, bridge.store)
    if fleet_routing is not None:  # the bridge joins the fleet once its port is bound
        bridge.attach_fleet(member := join_fleet(settings, bridge, port))
        fleet_routing.join(member)
    endpoint = MetricsEndpoint(metrics.registry, settings.server.host, settings.metrics.port)
    http = None
    if settings.http.port:
        app = create_app(
            bridge,
            metrics,
            tenants,
            settings.auth.admin_tenants,
            session_ttl_s=settings.http.session_ttl_s,
            max_body_bytes=settings.http.max_body_bytes,
            weights_changed=worker.weights_changed if worker is not None and worker.broadcasts else None,
        )
        http = HttpFrontDoor(app, settings.server.host, settings.http.port, settings.server.grace_period_s)
    metrics_endpoint = endpoint if settings.metrics.port else None
    return BridgeServer(server, port, bridge, health, settings, tracing, metrics_endpoint, http)


async def serve(
    settings: Settings,
    ready: asyncio.Event | None = None,
    *,
    stuck_exit_s: float | None = STUCK_EXIT_S,
    worker: WorkerSlot | None = None,
) -> None:
    """The process's main loop: run until SIGINT/SIGTERM, then shut down gracefully.

    A second signal cuts the drain short. If the shutdown is still not done ``stuck_exit_s`` after the
    grace period, the process logs where it hung and exits with status 1 (None: never).
    """
    bridge_server = await create_server(settings, worker=worker)
    await bridge_server.start()
    info = bridge_server.bridge.info
    log.info(
        "PrimeRL bridge serving %s (%s engine, %d replica(s)) on %s",
        info.model,
        info.engine,
        len(bridge_server.bridge.engines),
        bridge_server.address,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info(
        "shutting down: draining in-flight Steps for up to %.0f s (signal again to stop now)",
        settings.server.grace_period_s,
    )
    began = loop.time()
    pending: set[asyncio.Task[None]] = set()
    if stuck_exit_s is not None:
        # A stop that hangs (a stuck engine close, a thread that never ends) must not keep the process
        # alive: past the grace period plus stuck_exit_s, say where it hung and exit. Not cancelled when
        # serve() returns, so it also covers the interpreter's own exit.
        limit = settings.server.grace_period_s + stuck_exit_s

        def stuck() -> None:
            log.error(
                "shutdown still not done %.0f s after the signal (at: %s): exiting now", limit, bridge_server.stop_phase
            )
            logging.shutdown()
            os._exit(1)

        watchdog = threading.Timer(limit, stuck)
        watchdog.daemon = True
        watchdog.start()

    def stop_now() -> None:  # an operator's second Ctrl-C / SIGTERM: cancel what is still running
        log.warning("second signal: cancelling in-flight Steps now")
        task = loop.create_task(bridge_server.server.stop(0))
        pending.add(task)
        task.add_done_callback(pending.discard)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_now)
    await bridge_server.stop()
    log.info("stopped after %.1f s", loop.time() - began)
