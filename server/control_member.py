"""A bridge's membership in a fleet: heartbeat, the shared policy version, and fleet-wide weight updates.

One policy version per model across all bridges (``placement.registry`` holds it in Redis):

* **Adoption.** A bridge labels tokens and salts the prefix cache with its replicas' versions. When the
  registry's version of its model is newer, the bridge adopts it before the next turn opens: a shared (HTTP)
  replica, already reloaded by the bridge that ran the update, is relabelled (``adopt_version``); a private
  (in-process) one is reloaded from the registry's weight location. The registry is read at every heartbeat
  and, with ``fleet.check_each_turn`` (default), once more when each turn opens (one Redis round trip), so a
  bridge never tags a token or builds a salt with a version the fleet has left, even between heartbeats.
* **Updates** (``update_weights``, through any bridge): ``begin_update`` marks the update in Redis; every bridge
  sees it (its poll or its next turn), pauses new turns on the model (``mode=abort``: aborts the running ones,
  partial tokens kept), waits for its Steps in flight to end and acks; once every live bridge acked, the updating
  bridge reloads each replica once, ``commit_update`` bumps the version atomically, and every bridge adopts it
  before resuming. Nothing is applied when Redis is unreachable (UNAVAILABLE) or a bridge never drains.
* **Fail open.** A failed registry read keeps the last-known record and counts
  ``primerl_fail_open_total{component="fleet_registry"}``; a pause whose update cannot be seen ending (Redis
  lost) ends after ``fleet.update_timeout_s``.
* **Ownership.** Episodes started here are recorded as owned by this bridge's address (with a TTL), so a
  bridge that gets a Step for an episode it does not hold can find its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from engines.base import Engine
from engines.types import WeightUpdate
from observability.metrics import BridgeMetrics
from placement.registry import BridgeRecord, FleetConfig, FleetStore, ModelRecord, RegistryUnavailable, Update
from server.config import Settings
from server.errors import EngineUnavailable, InvalidArgument, PrimeRLError

log = logging.getLogger("primerl.fleet")
COMPONENT = "fleet_registry"


class FleetBridge(Protocol):
    """What the membership needs from the bridge (``server.bridge.Bridge`` satisfies it)."""

    @property
    def engines(self) -> Sequence[Engine]: ...
    @property
    def metrics(self) -> BridgeMetrics: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    async def pause(self, abort: bool) -> int: ...
    def resume(self) -> None: ...


def default_bridge_id(address: str) -> str:
    return f"{socket.gethostname()}:{address.rsplit(':', 1)[-1]}:{os.getpid()}"


class FleetMember:
    """One bridge's view of the registry (see module docstring)."""

    def __init__(self, store: FleetStore, config: FleetConfig, model: str, address: str, tenant: str = "") -> None:
        self.store = store
        self.config = config
        self.model = model
        self.address = address
        self.id = config.bridge_id or default_bridge_id(address)
        self.tenant = tenant
        self.record = ModelRecord(model)  # last known
        self.bridge: FleetBridge | None = None
        self._paused_for: Update | None = None  # the update this bridge paused for
        self._paused_at = 0.0
        self._acked: str = ""
        self._task: asyncio.Task[None] | None = None
        self._adopting = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, bridge: FleetBridge) -> None:
        """Register and adopt the fleet's version (Redis down: start with what the engines say, fail open)."""
        self.bridge = bridge
        await self.refresh()
        with contextlib.suppress(RegistryUnavailable):
            await self.heartbeat()
        self._task = asyncio.create_task(self._run(), name=f"fleet-member-{self.id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(RegistryUnavailable):
            await self.store.leave(self.id)
        await self.store.close()

    async def _run(self) -> None:
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                with contextlib.suppress(RegistryUnavailable):
                    await self.heartbeat()
                next_beat = now + self.config.heartbeat_s
            await self.refresh()
            busy = self._paused_for is not None or self.record.update is not None
            await asyncio.sleep(self.config.poll_s if busy else min(self.config.heartbeat_s, next_beat - now))

    async def heartbeat(self) -> None:
        load = self.bridge.inflight if self.bridge is not None else 0
        record = BridgeRecord(self.id, self.address, (self.model,), self.tenant, load, time.time())
        await self.store.heartbeat(record, self.config.heartbeat_s * 3)

    # -- the registry's record -----------------------------------------------------------------

    async def refresh(self) -> ModelRecord:
        """Read the model's record and act on it; Redis down: the last-known record (counted)."""
        try:
            record = await self.store.model(self.model)
        except RegistryUnavailable as exc:
            self.failed_open(exc)
            if self._paused_for is not None and time.monotonic() - self._paused_at > self.config.update_timeout_s:
                self._resume("its update could not be seen ending within fleet.update_timeout_s")
            return self.record
        self.record = record
        await self._act(record)
        return record

    async def before_turn(self) -> None:
        """At turn admission: adopt a newer fleet version (``check_each_turn``: from a fresh read)."""
        if self.config.check_each_turn:
            await self.refresh()

    async def _act(self, record: ModelRecord) -> None:
        bridge = self.bridge
        if bridge is None:
            return
        update = record.update
        if update is not None and self._paused_for is None and update.target > bridge.policy_version:
            self._paused_for, self._paused_at = update, time.monotonic()
            await bridge.pause(abort=update.mode == "abort")
            log.info("fleet update of %s to version %d: new turns paused", self.model, update.target)
        drained = bridge.inflight == 0  # the updating bridge may reload the replicas
        if update is not None and self._acked != update.token and self._paused_for is not None and drained:
            await self.store.ack(self.model, update.target, self.id)
            self._acked = update.token
        if record.version > bridge.policy_version:
            await self.adopt(record)
        if update is None and self._paused_for is not None:
            self._resume(f"the fleet is at version {record.version}")

    def _resume(self, why: str) -> None:
        self._paused_for = None
        if self.bridge is not None:
            self.bridge.resume()
        log.info("fleet: new turns on %s resumed (%s)", self.model, why)

    async def adopt(self, record: ModelRecord) -> None:
        """Move every replica of this bridge to the fleet's version (see module docstring)."""
        async with self._adopting:
            for engine in self.bridge.engines if self.bridge is not None else ():
                if engine.policy_version >= record.version:
                    continue
                adopt: Callable[[int], None] | None = getattr(engine, "adopt_version", None)
                if adopt is not None:  # a shared replica: reloaded once, by the bridge that ran the update
                    adopt(record.version)
                elif record.weights:  # a private replica: this bridge loads the weights itself
                    await engine.update_weights(WeightUpdate(record.weights, record.version))
            log.info("fleet: %s adopted policy version %d", self.model, record.version)

    # -- fleet-wide weight update ---------------------------------------------------------------

    async def update_weights(self, path: str, version: int, mode: str, apply: Callable[[int], Awaitable[int]]) -> int:
        """Pause the fleet, reload each replica once (``apply(version)``), bump the version, resume."""
        update, _ = await self.store.begin_update(self.model, version, mode)
        try:
            await self._act(update_record(self.record, update))  # this bridge pauses and drains like the others
            await self._wait_for_acks(update)
            done = await apply(update.target)
        except BaseException:
            with contextlib.suppress(PrimeRLError):  # the original error is the one to report
                if self.bridge is not None and self.bridge.policy_version >= update.target:
                    await self.store.commit_update(self.model, update, path)  # applied on some replicas
                else:
                    await self.store.end_update(self.model, update)  # nothing applied: resume at the old version
            if self._paused_for is not None:
                self._resume("the update failed")
            raise
        await self.store.commit_update(self.model, update, path)
        await self.refresh()
        return done

    async def _wait_for_acks(self, update: Update) -> None:
        deadline = time.monotonic() + self.config.update_timeout_s
        while True:
            if self._acked != update.token and self.bridge is not None and self.bridge.inflight == 0:
                await self.store.ack(self.model, update.target, self.id)
                self._acked = update.token
            live = {b.id for b in await self.store.bridges(self.model)} | {self.id}
            missing = live - await self.store.acks(self.model, update.target)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"bridges {sorted(missing)} did not drain their turns for the update to version {update.target} "
                    f"within fleet.update_timeout_s = {self.config.update_timeout_s} s; nothing was applied"
                )
            await asyncio.sleep(self.config.poll_s / 2)

    # -- episode ownership ----------------------------------------------------------------------

    async def own(self, episode_ids: list[str]) -> None:
        try:
            await self.store.own(episode_ids, self.address)
        except RegistryUnavailable as exc:
            self.failed_open(exc)

    async def disown(self, episode_id: str) -> None:
        try:
            await self.store.disown(episode_id)
        except RegistryUnavailable as exc:  # the record expires by itself (fleet.episode_ttl_s)
            self.failed_open(exc)

    def failed_open(self, exc: PrimeRLError) -> None:
        """A registry call failed: go on with the last-known record, counted and logged."""
        if self.bridge is not None:
            self.bridge.metrics.fail_open.labels(COMPONENT).inc()
        log.warning("%s; serving with the last-known registry (version %d)", exc.message, self.record.version)


def update_record(record: ModelRecord, update: Update) -> ModelRecord:
    return ModelRecord(record.name, record.version, record.weights, record.replicas, update, record.read_at)


def join_fleet(settings: Settings, model: str, port: int) -> FleetMember:
    """The membership a bridge serving ``model`` on ``port`` gets from ``settings.fleet`` (needs ``redis.url``)."""
    if not settings.redis.url:
        raise InvalidArgument("fleet.enabled needs redis.url (the Redis that holds the fleet registry)")
    config = settings.fleet
    address = config.advertise_address or f"{settings.server.host}:{port}"
    return FleetMember(FleetStore.connect(settings.redis.url, config), config, model, address)
