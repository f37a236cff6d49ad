"""A bridge's membership in a fleet: heartbeat, the shared policy version, and fleet-wide weight updates.

One policy version per model across all bridges (``placement.registry`` holds it in Redis):

* **Adoption.** A bridge labels tokens and salts the prefix cache with its replicas' versions. When the
  registry's version of its model is newer, the bridge adopts it before the next turn opens: a shared (HTTP)
  replica, already reloaded by the bridge that ran the update, is relabelled (``adopt_version``); a private
  (in-process) one is reloaded from the registry's weight location. Two mechanisms, either one sufficient while
  Redis is up: (1) the update barrier below: no version is committed until every live bridge paused and drained,
  and a paused bridge adopts before it resumes; (2) with ``fleet.check_each_turn`` (default) each turn open reads
  the record's stamp (one GET) and re-reads the record when it moved, which also covers a bridge the barrier
  missed (its heartbeat lost with Redis's data). The background loop reads the record every ``fleet.poll_s``.
* **Updates** (``update_weights``, through any bridge): ``begin_update`` marks the update in Redis; every bridge
  sees it (its poll or its next turn), pauses new turns on the model (``mode=abort``: aborts the running ones,
  partial tokens kept), waits for its Steps in flight to end and acks; once every live bridge acked, the updating
  bridge reloads each replica once, ``commit_update`` bumps the version atomically, and every bridge adopts it
  before resuming. Nothing is applied when Redis is unreachable (UNAVAILABLE) or a bridge never drains.
* **Fail open.** A failed registry read keeps the last-known record and counts
  ``primerl_fail_open_total{component="fleet_registry"}``; a pause whose update cannot be seen ending (Redis
  lost) ends after ``fleet.update_timeout_s``. Turns skip the registry for a heartbeat after a failed read,
  until a background read succeeds again. An update run within two heartbeats of the registry's return (or
  of it losing its data) waits out that time before counting the live bridges: by then each has heartbeated
  again, so none is left out of the barrier.
* **Replicas.** ``converge`` makes this bridge's replicas what the registry lists (new ones added; drained,
  removed or down ones out of rotation) through the bridge's replica API (``Bridge.replicas``: ``add``,
  ``withdraw``, ``restore``); it writes none of the bridge's state itself.
* **Ownership.** Episodes started here are recorded as owned by this bridge's address (with a TTL), so a
  bridge that gets a Step for an episode it does not hold can find its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from core.tasks import cancel_and_wait
from core.types import WeightUpdate
from placement.registry import (
    BridgeRecord,
    FleetConfig,
    FleetStore,
    ModelRecord,
    RegistryUnavailable,
    ReplicaRecord,
    Update,
)
from server.bridge import Bridge
from server.config import Settings
from server.errors import EngineUnavailable, InvalidArgument, PrimeRLError

log = logging.getLogger("primerl.fleet")
COMPONENT = "fleet_registry"


def default_bridge_id(address: str) -> str:
    return f"{socket.gethostname()}:{address.rsplit(':', 1)[-1]}:{os.getpid()}"


class FleetMember:
    """One bridge's view of the registry (see module docstring)."""

    def __init__(
        self, store: FleetStore, config: FleetConfig, model: str, address: str, bridge: Bridge, tenant: str = ""
    ) -> None:
        self.store = store
        self.config = config
        self.model = model
        self.address = address
        self.id = config.bridge_id or default_bridge_id(address)
        self.tenant = tenant
        self.record = ModelRecord(model)  # last known
        self.bridge = bridge
        self._paused_for: Update | None = None  # the update this bridge paused for
        self._paused_at = 0.0
        self._acked: str = ""
        self._task: asyncio.Task[None] | None = None
        self._adopting = asyncio.Lock()
        self._registered = False
        self._written_stamp = 0  # the least stamp the registry had after our own listing (it only grows)
        self._down_until = 0.0  # turns skip the registry read until then (it just failed)
        self._back_at = 0.0  # when a registry read first succeeded after one failed or after the registry lost its data
        self._adding: set[str] = set()  # replica URLs being added now
        self._failures: dict[str, int] = {}  # replica URL -> times it failed (its fleet-wide backoff)
        self._healthy: list[bool] = []  # the router's health per replica at the last look (watch_health)
        self._tasks: set[asyncio.Task[None]] = set()  # registry writes in flight (owned: cancelled on close)

    @property
    def version(self) -> int:
        """The fleet's policy version of this model (the last-known record's)."""
        return self.record.version

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Register and adopt the fleet's version (Redis down: start with what the engines say, fail open)."""
        await self.refresh()
        with contextlib.suppress(RegistryUnavailable):
            await self.heartbeat()
        self._task = asyncio.create_task(self._run(), name=f"fleet-member-{self.id}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._task is not None:
            await cancel_and_wait(self._task)
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
            await asyncio.sleep(self.config.poll_s)

    async def heartbeat(self) -> None:
        record = BridgeRecord(self.id, self.address, (self.model,), self.tenant, self.bridge.inflight, time.time())
        await self.store.heartbeat(record, self.config.heartbeat_s * 3)

    # -- the registry's record -----------------------------------------------------------------

    async def refresh(self) -> ModelRecord:
        """Read the model's record and act on it; Redis down: the last-known record (counted)."""
        try:
            record = await self.store.model(self.model)
        except RegistryUnavailable as exc:
            self.failed_open(exc)
            self._down_until = time.monotonic() + self.config.heartbeat_s
            if self._paused_for is not None and time.monotonic() - self._paused_at > self.config.update_timeout_s:
                self._resume("its update could not be seen ending within fleet.update_timeout_s")
            return self.record
        # The registry lost its data (a Redis restart): its stamp went back, or, after an outage, our list is gone.
        # Our own listing counts as seen: a restart right after it, before we read it back, is a loss too.
        lost = record.stamp < max(self.record.stamp, self._written_stamp)
        if (lost or self._down_until) and not record.replicas:
            self._registered = False  # list our replicas again
        if lost or self._down_until:  # the first good read since a failed one (a turn's or the background's)
            self._back_at, self._down_until = time.monotonic(), 0.0  # and turns read the registry again
        self.record = record
        try:
            await self._act(record)
        except RegistryUnavailable as exc:  # an ack or a replica write: the next read tries again
            self.failed_open(exc)
        return record

    async def before_turn(self) -> None:
        """At turn admission (``check_each_turn``): one GET of the record's stamp, and a whole read when it moved,
        so a new version is adopted before this turn; skipped for a heartbeat after a registry failure (the
        background reads retry it, turns do not wait on a dead Redis)."""
        if not self.config.check_each_turn or time.monotonic() < self._down_until:
            return
        try:
            stamp = await self.store.stamp(self.model)
        except RegistryUnavailable as exc:
            self.failed_open(exc)
            self._down_until = time.monotonic() + self.config.heartbeat_s
            return
        if stamp != self.record.stamp:  # the record changed since the last read: read it whole and act
            await self.refresh()

    async def _act(self, record: ModelRecord) -> None:
        bridge = self.bridge
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
        await self.converge(record)
        self.watch_health()
        if update is None and self._paused_for is not None:
            self._resume(f"the fleet is at version {record.version}")

    def _resume(self, why: str) -> None:
        self._paused_for = None
        self.bridge.metrics.weight_update_phase("held", time.monotonic() - self._paused_at)
        self.bridge.resume()
        log.info("fleet: new turns on %s resumed (%s)", self.model, why)

    async def adopt(self, record: ModelRecord) -> None:
        """Move every replica of this bridge to the fleet's version (see module docstring)."""
        async with self._adopting:
            began, reloaded = time.perf_counter(), False
            for i, engine in enumerate(self.bridge.engines):
                if engine.policy_version >= record.version:
                    continue
                adopt: Callable[[int], None] | None = getattr(engine, "adopt_version", None)
                if adopt is not None:  # a shared replica: reloaded once, by the bridge that ran the update
                    adopt(record.version)
                elif record.weights:  # a private replica: this bridge loads the weights itself
                    await engine.update_weights(WeightUpdate(record.weights, record.version))
                    reloaded = True
                self.bridge.weights.adopted(i, record.weights)
            if reloaded:  # its replicas generated nothing meanwhile: this bridge's pause
                self.bridge.metrics.weight_update_phase("pause", time.perf_counter() - began)
            log.info("fleet: %s adopted policy version %d", self.model, record.version)

    # -- replicas added, drained and removed at run time ------------------------------------------

    async def converge(self, record: ModelRecord) -> None:
        """Make this bridge's replicas what the registry lists (an empty list: register ours, once, and again
        after the registry lost its data; see ``refresh``)."""
        bridge = self.bridge
        urls = [str(getattr(e, "url", "")) for e in bridge.engines]
        if not record.replicas:
            if all(urls) and not self._registered:  # shared (HTTP) replicas: the fleet's list starts with ours
                ours = [ReplicaRecord(url, e.info.engine) for url, e in zip(urls, bridge.engines, strict=True)]
                await self.store.put_replicas(self.model, ours)  # one transaction: never seen half-listed
                self._registered = True
                self._written_stamp = record.stamp + 1  # put_replicas bumped the stamp we read
            return
        listed = {r.url: r for r in record.replicas}
        down = {url for url, until in record.down if until > time.time()}
        withdrawn = bridge.replicas.withdrawn  # read only: the replica API below changes it
        for i, url in enumerate(urls):
            entry = listed.get(url)
            state = "removed" if entry is None else "down" if url in down else entry.state
            if state == "active" and i in withdrawn:
                bridge.replicas.restore(i, confirm=withdrawn[i] in ("down", "removed"))
            elif state != "active" and withdrawn.get(i) != state:
                await bridge.replicas.withdraw(i, state, abort=state == "removed")
        for url in listed.keys() - set(urls) - self._adding:
            if listed[url].state == "active":
                self._adding.add(url)  # a turn opening meanwhile must not add it twice
                try:
                    await self._add(url, record)
                finally:
                    self._adding.discard(url)

    async def _add(self, url: str, record: ModelRecord) -> None:
        """A replica new to this bridge, at the fleet's version (loaded there when it is behind)."""
        template: Any = self.bridge.engines[0]
        template = getattr(template, "inner", template)  # under a tracing proxy
        if not hasattr(template, "url"):
            log.warning(
                "fleet: replica %s not added: this bridge's %s engines are in-process", url, template.info.engine
            )
            return
        name = f"{template.info.engine}-{len(self.bridge.engines)}"
        engine = type(template)(
            url,
            template.config,
            template.facts,
            model=template.info.model,
            tokenizer=template.tokenizer,
            request_timeout_s=template._request_timeout_s,
            replica=name,
        )
        await engine.start()
        if engine.policy_version < record.version:
            if not record.weights:
                log.warning("fleet: replica %s not added: no weight location for version %d", url, record.version)
                return
            await engine.update_weights(WeightUpdate(record.weights, record.version))
        self.bridge.replicas.add(engine)
        log.info("fleet: replica %s (%s) added at version %d", url, name, record.version)

    def watch_health(self) -> None:
        """A replica this bridge took out of rotation (a call or health check failed; not a withdrawal) goes out
        fleet-wide for a backoff that doubles each time it fails again (``fleet.replica_backoff_s``, up to 64 x)."""
        healthy = list(self.bridge.router.replicas.healthy)
        for i, (was, now) in enumerate(zip(self._healthy, healthy, strict=False)):
            if was and not now and i not in self.bridge.replicas.withdrawn:
                self._replica_failed(str(getattr(self.bridge.engines[i], "url", "")))
        self._healthy = healthy

    def _replica_failed(self, url: str) -> None:
        if not url:
            return
        n = self._failures[url] = self._failures.get(url, 0) + 1
        until = time.time() + self.config.replica_backoff_s * 2 ** min(n - 1, 6)
        task = asyncio.create_task(self._mark_down(url, until), name=f"fleet-mark-down-{url}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark_down(self, url: str, until: float) -> None:
        try:
            await self.store.mark_down(self.model, url, until)
        except RegistryUnavailable as exc:
            self.failed_open(exc)

    # -- fleet-wide weight update ---------------------------------------------------------------

    async def update_weights(self, path: str, version: int, mode: str, apply: Callable[[int], Awaitable[int]]) -> int:
        """Pause the fleet, reload each replica once (``apply(version)``), bump the version, resume."""
        if not version:  # the registry may have lost its data (a Redis restart)
            version = max(self.record.version, self.bridge.policy_version) + 1
        update, _ = await self.store.begin_update(self.model, version, mode)
        try:
            began = time.perf_counter()
            await self._act(update_record(self.record, update))  # this bridge pauses and drains like the others
            await self._wait_for_acks(update)
            self.bridge.metrics.weight_update_phase("drain", time.perf_counter() - began)  # every bridge's
            done = await apply(update.target)
        except BaseException:
            with contextlib.suppress(PrimeRLError):  # the original error is the one to report
                if self.bridge.policy_version >= update.target:
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
        settle = self._back_at + 2 * self.config.heartbeat_s - time.monotonic()
        if self._back_at and settle > 0:
            # The registry is back from an outage (or lost its data): a bridge whose heartbeat it has not seen yet
            # would be left out of the barrier and serve the reloaded shared replicas at the old version.
            log.info("the fleet registry is back: %.1f s for every bridge's heartbeat before counting acks", settle)
            await asyncio.sleep(settle)
        while True:
            if self._acked != update.token and self.bridge.inflight == 0:
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
            holder = self.bridge.journal.owner if self.bridge.journal is not None else ""
            await self.store.own(episode_ids, self.address, holder)
        except RegistryUnavailable as exc:
            self.failed_open(exc)

    async def disown(self, episode_id: str) -> None:
        try:
            await self.store.disown(episode_id)
        except RegistryUnavailable as exc:  # the record expires by itself (fleet.episode_ttl_s)
            self.failed_open(exc)

    async def bridges(self) -> list[BridgeRecord]:
        """The live bridges serving this model (the inspector's fleet view); [] while the registry is down."""
        try:
            return await self.store.bridges(self.model)
        except RegistryUnavailable as exc:
            self.failed_open(exc)
            return []

    def failed_open(self, exc: PrimeRLError) -> None:
        """A registry call failed: go on with the last-known record, counted and logged."""
        self.bridge.metrics.fail_open.labels(COMPONENT).inc()
        log.warning("%s; serving with the last-known registry (version %d)", exc.message, self.record.version)


def update_record(record: ModelRecord, update: Update) -> ModelRecord:
    return dataclasses.replace(record, update=update)


def join_fleet(settings: Settings, bridge: Bridge, port: int) -> FleetMember:
    """The membership ``bridge``, serving on ``port``, gets from ``settings.fleet`` (needs ``redis.url``)."""
    if not settings.redis.url:
        raise InvalidArgument("fleet.enabled needs redis.url (the Redis that holds the fleet registry)")
    config = settings.fleet
    address = config.advertise_address or f"{settings.server.host}:{port}"
    return FleetMember(FleetStore.connect(settings.redis.url, config), config, bridge.info.model, address, bridge)
