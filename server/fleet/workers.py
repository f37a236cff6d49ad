"""``primerl serve --workers N``: N bridge processes on one port, each with its own event loop.

Layout
------
* The parent process serves nothing: it starts N workers (``multiprocessing`` spawn), restarts one that
  dies, and on SIGTERM/SIGINT stops them gracefully (each drains its Steps for ``server.grace_period_s``).
* Every worker is a whole bridge (``server.app.serve``, which ``primerl serve`` passes to ``run_workers``: this
  package never imports the app that imports it): its own engines, episode store and event loop; all
  share the Redis index, the episode records (``persistence``) and the engines' servers. Each binds the
  public port with ``SO_REUSEPORT`` (the kernel spreads *connections* over the workers) and a private unix
  socket, the address its peers forward to.
* An episode belongs to the worker that started it: its id says which (``ep-w<index>-...``). A call for an
  episode (any request with an ``episode_id``: Step, EndEpisode, ...) that reaches another worker is
  forwarded to the owner (``server.fleet.forward``): tokens, status codes, details and metadata come back
  unchanged, so a client never sees which worker its channel landed on. Calls carry the ``primerl-worker``
  trailer (the worker that ran them) and, when forwarded, ``primerl-forwarded-by``.
* A dead owner: with persistence on, the worker that got the call takes the episode over (it loads the
  record from Redis, as a second bridge would); with it off the episode is lost with the worker and the
  call fails UNAVAILABLE saying so. The parent logs which case applies when it restarts a worker. A worker
  killed mid-Step leaves that episode's Step lease behind: each worker process leases with a token its
  parent gave it, and the worker that replaces a crashed one drops, before it serves, every lease the
  slot's earlier processes held (the newest 8 tokens: also those of a replacement that died first), so the
  episode's next Step does not wait for the lease to expire (``persistence.lease_ms``). Between the crash
  and the replacement's start (or when Redis does not answer then) its Steps are still refused as busy.
* UpdateWeights runs on the worker that got it, then on every other worker at the version it chose (each
  worker has its own engines); a worker it fails on is named in the error. With ``fleet.enabled`` the
  fleet's control plane keeps the versions instead (each worker is a fleet member). A worker restarted after
  a crash starts from its configured weights: update the weights again (or run the fleet) after a restart.
  The HTTP front door's weight routes (``/update_weights``, ``/reload_weights``, on worker 0) do the same.
* Per worker: ``metrics.port + index`` serves its /metrics (scrape each: per-process series, no shared
  multiprocess directory, so gauges and callbacks stay exact); the HTTP front door runs on worker 0 only
  (its sessions live in one process); admission limits (``admission.*``) apply per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import grpc

from core.errors import EngineUnavailable, PrimeRLError
from core.proof import WeightProof
from proto.primerl.v1 import primerl_pb2 as pb
from server.config import Settings
from server.fleet.forward import default_forwarder, forwarded_metadata
from server.fleet.ownership import Owner, OwnerInterceptorBase
from server.requestid import configure_logging
from server.service import ACCEPTED_METADATA

log = logging.getLogger("primerl.workers")

WORKER_TRAILER = "primerl-worker"
FORWARDED_BY = "primerl-forwarded-by"
UPDATE_WEIGHTS = "/primerl.v1.PrimeRL/UpdateWeights"
_ID_PREFIX = "ep-w"
PREDECESSORS_KEPT = 8  # lease tokens of a slot's earlier processes handed to its next one
FAST_FAILURE_S = 10.0  # a worker that dies sooner than this after starting counts as failing to start
MAX_FAST_FAILURES = 5  # in a row, for one worker: give up (a config error, a port in use) instead of spinning
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSlot:
    """One worker's place: its index and every worker's private address (by index)."""

    index: int
    addresses: tuple[str, ...]
    broadcast_weights: bool = True  # UpdateWeights reaches every worker (off when the fleet's control plane does it)
    lease_owner: str = ""  # this worker process's token in the Step leases it takes (persistence on)
    predecessors: tuple[str, ...] = ()  # lease tokens of the earlier processes of this slot: their leases are dropped

    @property
    def count(self) -> int:
        return len(self.addresses)

    @property
    def id_prefix(self) -> str:
        return f"{_ID_PREFIX}{self.index}-"

    def owner_of(self, episode_id: str) -> int | None:
        """The index of the worker that owns ``episode_id`` (None: not a worker's id, or no such worker)."""
        if not episode_id.startswith(_ID_PREFIX):
            return None
        head, _, rest = episode_id[len(_ID_PREFIX) :].partition("-")
        if not rest or not head.isdigit():
            return None
        owner = int(head)
        return owner if owner < self.count else None

    def settings_for(self, settings: Settings) -> Settings:
        """This worker's settings: its own /metrics port and fleet name, the HTTP front door on worker 0 only."""
        metrics_port = settings.metrics.port + self.index if settings.metrics.port else 0
        http_port = settings.http.port if self.index == 0 else 0
        fleet_id = f"{settings.fleet.bridge_id}-w{self.index}" if settings.fleet.bridge_id else ""
        return settings.model_copy(
            update={
                "metrics": settings.metrics.model_copy(update={"port": metrics_port}),
                "http": settings.http.model_copy(update={"port": http_port}),
                "fleet": settings.fleet.model_copy(update={"bridge_id": fleet_id}),
            }
        )

    def server_options(self) -> list[tuple[str, Any]]:
        return [("grpc.so_reuseport", 1)]

    def attach(self, server: grpc.aio.Server, store: Any) -> None:
        """Bind the private address and give the episode store this worker's id prefix."""
        address = self.addresses[self.index]
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            if os.path.exists(path):  # left by this worker's previous process
                os.unlink(path)
        if server.add_insecure_port(address) == 0:
            raise OSError(f"cannot bind the worker's private address {address}")
        store.id_prefix = self.id_prefix

    def peers(self) -> list[tuple[int, str]]:
        return [(i, a) for i, a in enumerate(self.addresses) if i != self.index]

    def interceptor(self, persistence: bool) -> OwnerInterceptor:
        return OwnerInterceptor(self, persistence)

    @property
    def broadcasts(self) -> bool:
        """Whether a weight update made on one worker is made on the others too (see the module docstring)."""
        return self.broadcast_weights and self.count > 1

    async def weights_changed(
        self, checkpoint_path: str, version: int, keep_kv: bool, authorization: str, proof: WeightProof | None = None
    ) -> None:
        """The HTTP front door's weight routes, after the update to ``version`` ran here: the same on every other
        worker (``authorization``: the HTTP caller's header, for the peers' own auth check; ``proof``: the caller's,
        which the peers' replicas must match too)."""
        request = pb.UpdateWeightsRequest(checkpoint_path=checkpoint_path, policy_version=version, keep_kv=keep_kv)
        if proof is not None:
            request.probe_token_ids.extend(proof.token_ids)
            request.probe_logprobs.extend(proof.logprobs)
            request.probe_tolerance = proof.tolerance
        metadata: tuple[tuple[str, str], ...] = ((FORWARDED_BY, str(self.index)),)
        if authorization:
            metadata += (("authorization", authorization),)
        failed = await update_peers(self, request, metadata, None)
        if failed is not None:
            raise EngineUnavailable(failed[1])


class OwnerInterceptor(OwnerInterceptorBase):
    """Runs a call for an episode on the worker that owns it (innermost: after auth, inside telemetry)."""

    hop_key = FORWARDED_BY
    owner_kind = "bridge worker"

    def __init__(self, slot: WorkerSlot, persistence: bool) -> None:
        super().__init__(persistence)
        self.slot = slot
        self.me = str(slot.index)
        self._hop = ((FORWARDED_BY, self.me),)
        self._broadcasts = slot.broadcasts

    def wraps(self, method: str) -> bool:
        return not method.startswith("/grpc.")

    async def owner(self, request: Any, context: grpc.aio.ServicerContext) -> Owner | None:
        owner = self.slot.owner_of(request.episode_id)
        if owner is None or owner == self.slot.index:
            return None
        return Owner(self.slot.addresses[owner], str(owner))

    def hop(self) -> tuple[tuple[str, str], ...]:
        return self._hop

    def served_here(self, context: grpc.aio.ServicerContext) -> None:
        trailers: list[tuple[str, Any]] = [(WORKER_TRAILER, self.me)]
        trailers += [(k, v) for k, v in context.invocation_metadata() or () if k == FORWARDED_BY]
        context.set_trailing_metadata(tuple(trailers))

    async def run_here(self, method: str, behavior: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = await behavior(request, context)
        if self._broadcasts and method == UPDATE_WEIGHTS and not self.forwarded(context):
            await self._broadcast(request, response, context)
        return response

    async def _broadcast(self, request: Any, response: Any, context: grpc.aio.ServicerContext) -> None:
        """After UpdateWeights ran here: the same version on every other worker (each has its own engines)."""
        peer = type(request)()
        peer.CopyFrom(request)
        peer.policy_version = response.policy_version
        metadata = forwarded_metadata(context, self._hop)
        failed = await update_peers(self.slot, peer, metadata, context.time_remaining())
        if failed is None:
            return
        code, message = failed
        await context.send_initial_metadata(ACCEPTED_METADATA)  # applied here: the client must not retry it
        await context.abort(code, message)


async def update_peers(slot: WorkerSlot, request: Any, metadata: Any, timeout: float | None) -> tuple[Any, str] | None:
    """Run ``request`` (an UpdateWeightsRequest at the version this worker just loaded) on every other worker;
    ``metadata`` must carry this worker's hop header, so the peers do not pass it on. None when every peer
    took it, else the status code of the first failure and a message naming every worker it failed on."""
    payload = request.SerializeToString()
    channel = default_forwarder().channel
    calls = [
        channel(target).unary_unary(UPDATE_WEIGHTS, None, None)(payload, timeout=timeout, metadata=metadata)
        for _, target in slot.peers()
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = [(i, r) for (i, _), r in zip(slot.peers(), results, strict=True) if isinstance(r, BaseException)]
    if not failed:
        return None
    code = failed[0][1].code() if isinstance(failed[0][1], grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
    errors = "; ".join(
        f"worker {i}: {r.details() if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__}" for i, r in failed
    )
    log.error("weights at version %d here but not on %s", request.policy_version, errors)
    message = (
        f"weights updated to version {request.policy_version} on bridge worker {slot.index} but not on {errors}; "
        "those workers keep the old weights until an update reaches them"
    )
    return code, message


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the parent dies, so a SIGKILLed parent leaves no orphans."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: a SIGKILLed parent leaves its workers
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Serve(Protocol):
    """A whole bridge's main loop as one worker (``server.app.serve``); picklable (a module-level function), since
    each worker process is spawned with it."""

    def __call__(self, settings: Settings, *, worker: WorkerSlot) -> Awaitable[None]: ...


def _worker_main(settings: Settings, slot: WorkerSlot, log_level: str, serve: Serve) -> None:
    """A worker process: a whole bridge on the shared port and its private address."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the parent only; it stops the workers in order
    _die_with_parent()
    configure_logging(log_level, f"worker {slot.index} ")

    async def run() -> None:
        try:
            await serve(slot.settings_for(settings), worker=slot)
        finally:
            await default_forwarder().close()

    try:
        asyncio.run(run())
    except (PrimeRLError, OSError) as exc:
        log.error("cannot start the bridge: %s", exc)
        raise SystemExit(2) from None


def _reserve_port(host: str) -> socket.socket:
    """A free port for ``--port 0``, held (bound, SO_REUSEPORT, not listening) until the workers are gone."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), 0))
    return sock


class Supervisor:
    """The parent: starts the workers, restarts the ones that die, stops them all on a signal."""

    def __init__(self, settings: Settings, count: int, log_level: str, serve: Serve) -> None:
        self.settings = settings
        self.count = count
        self.log_level = log_level
        self.serve = serve
        self._dir = tempfile.mkdtemp(prefix="primerl-workers-")  # 0700: only this user reaches the sockets
        self.addresses = tuple(f"unix:{self._dir}/w{i}.sock" for i in range(count))
        self._ctx = multiprocessing.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self._started: list[float] = [0.0] * count
        self._fast_failures = [0] * count
        # Each slot's newest lease tokens, oldest first: its current process's, after up to PREDECESSORS_KEPT earlier.
        self._tokens: list[list[str]] = [[] for _ in range(count)]
        self._signals = 0

    def _start(self, index: int) -> BaseProcess:
        """Start worker ``index`` with a fresh lease token; it drops the leases of the slot's earlier processes (the
        newest few: a replacement that itself died before it could drop them passes them on)."""
        earlier = tuple(self._tokens[index][-PREDECESSORS_KEPT:])
        token = f"w{index}-{secrets.token_hex(8)}"
        self._tokens[index] = [*earlier, token]
        slot = WorkerSlot(
            index,
            self.addresses,
            broadcast_weights=not self.settings.fleet.enabled,
            lease_owner=token,
            predecessors=earlier,
        )
        proc = self._ctx.Process(
            target=_worker_main, args=(self.settings, slot, self.log_level, self.serve), name=f"primerl-worker-{index}"
        )
        proc.start()
        self._started[index] = time.monotonic()
        log.info("worker %d started (pid %d)", index, proc.pid)
        return proc

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:  # a second signal: the workers cancel their in-flight Steps now
            self._signal_workers(signal.SIGTERM)

    def _signal_workers(self, sig: int) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, sig)

    def _restart(self, index: int) -> bool:
        """Restart a dead worker; False when it keeps dying at start (give up)."""
        proc = self.procs[index]
        lived = time.monotonic() - self._started[index]
        self._fast_failures[index] = self._fast_failures[index] + 1 if lived < FAST_FAILURE_S else 0
        if self._fast_failures[index] >= MAX_FAST_FAILURES:
            log.error("worker %d died %d times within %.0f s of starting: giving up", index, MAX_FAST_FAILURES, lived)
            return False
        lost = (
            "its open episodes resume from Redis (persistence on; the Step leases it held are dropped)"
            if self.settings.persistence.enabled
            else "its open episodes are LOST (persistence off; set persistence.enabled to keep them)"
        )
        log.error(
            "worker %d (pid %s) exited with code %s after %.0f s: restarting; %s",
            index,
            proc.pid,
            proc.exitcode,
            lived,
            lost,
        )
        time.sleep(min(0.2 * 2 ** self._fast_failures[index], 5.0))  # back off a worker that keeps failing
        self.procs[index] = self._start(index)
        return True

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.procs = [self._start(i) for i in range(self.count)]
            log.info("%d bridge workers on %s:%d", self.count, self.settings.server.host, self.settings.server.port)
            status = 0
            while not self._signals:
                multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=0.5)
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if not self._signals and not all(self._restart(i) for i in dead):
                    status = 1
                    break
            self._stop()
            return status
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop(self) -> None:
        log.info(
            "stopping %d workers (each drains its Steps for up to %.0f s)",
            self.count,
            self.settings.server.grace_period_s,
        )
        self._signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.server.grace_period_s + 40  # the workers' own watchdog: 30 s
        for i, proc in enumerate(self.procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker %d did not stop: killing it", i)
                proc.kill()
                proc.join(5)


def run_workers(settings: Settings, serve: Serve, log_level: str = "INFO") -> int:
    """``primerl serve --workers N`` (N = ``server.workers``): the parent's main; returns the exit status.

    ``serve``: each worker's main loop (``server.app.serve``)."""
    held = None
    if settings.server.port == 0:
        held = _reserve_port(settings.server.host)
        port = held.getsockname()[1]
        settings = settings.model_copy(update={"server": settings.server.model_copy(update={"port": port})})
    try:
        return Supervisor(settings, settings.server.workers, log_level, serve).run()
    finally:
        if held is not None:
            held.close()
