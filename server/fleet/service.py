"""The control plane (``primerl control serve``): the fleet registry over gRPC, with health, reflection and
Prometheus.

It holds no state of its own: ``placement.registry`` in Redis is the truth, so any number of control-plane
replicas may run and one that restarts loses nothing. Admin operations change the registry and bridges converge
at their next heartbeat (``server.fleet.member``); a fleet-wide weight update is run by a live bridge of the
model (forwarded there with the caller's metadata), because bridges drain their own turns. Errors: bad input
INVALID_ARGUMENT naming the field, unknown model or replica NOT_FOUND, Redis unreachable UNAVAILABLE (the codes of
``core.errors``, sent through ``core.errors_grpc``); a bug is INTERNAL without its detail, logged.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from core.errors import grpc_code_name
from core.errors_grpc import abort
from observability.fleet import ControlMetrics
from observability.metrics import MetricsEndpoint
from placement.registry import BridgeRecord, FleetConfig, FleetStore, ModelRecord, ReplicaRecord
from proto.primerl.v1 import control_pb2 as cpb
from proto.primerl.v1 import control_pb2_grpc as cpb_grpc
from proto.primerl.v1 import primerl_pb2 as pb
from server.errors import InvalidArgument, NotFound
from server.fleet.forward import Route, default_forwarder

log = logging.getLogger("primerl.control")
SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["Control"].full_name
UPDATE_WEIGHTS = "/primerl.v1.PrimeRL/UpdateWeights"


def _bridge(b: BridgeRecord) -> cpb.FleetBridge:
    return cpb.FleetBridge(id=b.id, address=b.address, models=b.models, tenant=b.tenant, load=b.load, seen=b.seen)


def _model(m: ModelRecord, bridges: list[BridgeRecord]) -> cpb.FleetModel:
    replicas = [
        cpb.FleetReplica(
            url=r.url,
            engine=r.engine,
            kv_capacity_tokens=r.kv_capacity_tokens,
            mig_profile=r.mig_profile,
            state=r.state,
        )
        for r in m.replicas
    ]
    updating = m.update.target if m.update is not None else 0
    return cpb.FleetModel(
        name=m.name,
        policy_version=m.version,
        weights=m.weights,
        replicas=replicas,
        updating_to=updating,
        bridges=[_bridge(b) for b in bridges],
    )


def _replica(req: cpb.ReplicaRequest) -> tuple[str, ReplicaRecord]:
    if not req.model:
        raise InvalidArgument("model is empty: name the model the replica serves")
    r = req.replica
    if not r.url.startswith(("http://", "https://")):
        raise InvalidArgument(f"replica.url {r.url!r} must start with http:// or https://")
    if r.kv_capacity_tokens < 0:
        raise InvalidArgument(f"replica.kv_capacity_tokens must be >= 0, got {r.kv_capacity_tokens}")
    return req.model, ReplicaRecord(r.url.rstrip("/"), r.engine, r.kv_capacity_tokens, r.mig_profile)


class ControlService(cpb_grpc.ControlServicer):
    """The ``Control`` service over the registry (see module docstring)."""

    def __init__(self, store: FleetStore, metrics: ControlMetrics) -> None:
        self.store = store
        self.metrics = metrics

    async def _run(self, method: str, context: grpc.aio.ServicerContext, work: Any) -> Any:
        try:
            result = await work
        except Exception as exc:  # noqa: BLE001 - a PrimeRLError: its code; anything else: INTERNAL (a bug, logged)
            self.metrics.requests.labels(method, grpc_code_name(exc)).inc()
            await abort(context, exc, log)
        self.metrics.requests.labels(method, "OK").inc()
        return result

    async def _record(self, model: str) -> cpb.FleetModel:
        if not model:
            raise InvalidArgument("model is empty: name a model of the fleet")
        record = await self.store.model(model)
        bridges = await self.store.bridges(model)
        if not bridges and not record.replicas and model not in await self.store.models():
            raise NotFound(f"the fleet has no model {model!r}; known: {await self.store.models()}")
        return _model(record, bridges)

    async def ListBridges(self, request: cpb.ListBridgesRequest, context: Any) -> cpb.ListBridgesResponse:
        async def work() -> cpb.ListBridgesResponse:
            return cpb.ListBridgesResponse(bridges=[_bridge(b) for b in await self.store.bridges(request.model)])

        return await self._run("ListBridges", context, work())

    async def GetModel(self, request: cpb.GetModelRequest, context: Any) -> cpb.FleetModel:
        return await self._run("GetModel", context, self._record(request.model))

    async def LocateEpisode(self, request: cpb.LocateEpisodeRequest, context: Any) -> cpb.LocateEpisodeResponse:
        async def work() -> cpb.LocateEpisodeResponse:
            if not request.episode_id:
                raise InvalidArgument("episode_id is empty")
            owner, _ = await self.store.owner(request.episode_id)
            live = {b.address for b in await self.store.bridges()}
            return cpb.LocateEpisodeResponse(address=owner if owner in live else "")

        return await self._run("LocateEpisode", context, work())

    async def _set(self, request: cpb.ReplicaRequest, state: str) -> cpb.FleetModel:
        model, replica = _replica(request)
        if state != "active":
            replica = replace(await self.store.replica(model, replica.url), state="draining")
        await self.store.put_replica(model, replica)
        log.info("model %s: replica %s %s", model, replica.url, "added" if state == "active" else "draining")
        return await self._record(model)

    async def AddReplica(self, request: cpb.ReplicaRequest, context: Any) -> cpb.FleetModel:
        return await self._run("AddReplica", context, self._set(request, "active"))

    async def DrainReplica(self, request: cpb.ReplicaRequest, context: Any) -> cpb.FleetModel:
        return await self._run("DrainReplica", context, self._set(request, "draining"))

    async def RemoveReplica(self, request: cpb.ReplicaRequest, context: Any) -> cpb.FleetModel:
        async def work() -> cpb.FleetModel:
            model, replica = _replica(request)
            await self.store.remove_replica(model, replica.url)
            log.info("model %s: replica %s removed", model, replica.url)
            return await self._record(model)

        return await self._run("RemoveReplica", context, work())

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context: Any) -> pb.UpdateWeightsResponse:
        async def pick() -> str:
            if not request.model:
                raise InvalidArgument("model is empty: name the model whose fleet loads the weights")
            bridges = await self.store.bridges(request.model)
            if not bridges:
                raise NotFound(f"no live bridge serves model {request.model!r}")
            return min(bridges, key=lambda b: b.load).address

        target = await self._run("UpdateWeights", context, pick())
        route = Route(target, UPDATE_WEIGHTS, response_deserializer=pb.UpdateWeightsResponse.FromString)
        return await default_forwarder().unary(route, request, context)


@dataclass
class ControlServer:
    server: grpc.aio.Server
    port: int
    store: FleetStore
    health: HealthServicer
    metrics_endpoint: MetricsEndpoint | None

    async def start(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await default_forwarder().close()
        await self.store.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()


def create_control_server(
    redis_url: str, host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0, fleet: FleetConfig | None = None
) -> ControlServer:
    if not redis_url:
        raise InvalidArgument("the control plane needs redis.url (the Redis that holds the fleet registry)")
    store = FleetStore.connect(redis_url, fleet or FleetConfig())
    metrics = ControlMetrics()
    server = grpc.aio.server()
    cpb_grpc.add_ControlServicer_to_server(ControlService(store, metrics), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    endpoint = MetricsEndpoint(metrics.registry, host, metrics_port) if metrics_port else None
    return ControlServer(server, bound, store, health, endpoint)


async def serve_control(redis_url: str, host: str, port: int, metrics_port: int, fleet: FleetConfig) -> None:
    """Run the control plane until SIGINT/SIGTERM."""
    control = create_control_server(redis_url, host, port, metrics_port, fleet)
    await control.start()
    log.info("PrimeRL control plane on %s:%d (registry %s, prefix %r)", host, control.port, redis_url, fleet.key_prefix)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await control.stop()
