"""The fleet registry: which bridges and engine replicas serve each model, and at which policy version.

A pure data model plus its Redis store (no gRPC): the control plane (``primerl control serve``) and every
bridge of a fleet read and write it; Redis is the one source of truth (no home-made consensus).

Keys (``{p}`` = ``FleetConfig.key_prefix``)
-------------------------------------------
* ``{p}:model:{m}`` hash: ``version`` (the fleet's policy version of model ``m``) and ``weights`` (where they are).
* ``{p}:model:{m}:update`` hash, with a TTL: a fleet-wide weight update in progress (``target``, ``token``,
  ``mode``). Its presence pauses admission of new turns on ``m`` in every bridge; it expires by itself
  if the bridge running the update dies.
* ``{p}:model:{m}:acks:{target}`` set: bridges that paused and drained for the update to ``target``.
* ``{p}:model:{m}:replicas`` hash: engine replica URL -> JSON ``ReplicaRecord``.
* ``{p}:model:{m}:down`` hash: replica URL -> unix time until which every bridge keeps it out (it failed).
* ``{p}:model:{m}:stamp``: incremented by every write above, so a bridge checks for news with one GET.
* ``{p}:bridge:{id}`` JSON ``BridgeRecord`` with a TTL (the heartbeat); ``{p}:bridges`` the set of ids.
* ``{p}:episode:{id}``: the address of the bridge that owns the episode (and its episode-lease token), with a TTL.

Invariants
----------
* The version only moves forward and changes in one place, ``commit_update``: a WATCH/MULTI transaction that
  checks the update's token and that the new version is greater (Python ints, so the whole int64 range works).
* One update per model at a time (``begin_update`` creates the update key in a WATCH/MULTI transaction).
* Every call has a timeout; any Redis failure is a ``RegistryUnavailable`` (status UNAVAILABLE), so callers
  decide to fail open (serve with the last-known record) or refuse (version changes).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from core.errors import EngineUnavailable, FailedPrecondition, InvalidArgument, NotFound

T = TypeVar("T")
ReplicaState = Literal["active", "draining"]
MAX_VERSION = 2**63 - 1


class FleetConfig(BaseModel):
    """Membership of a fleet of bridges sharing one registry in the Redis at ``redis.url``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Register with the fleet registry and share one policy version per model.")
    bridge_id: str = Field("", max_length=128, description="This bridge's name in the fleet; empty = host:port:random.")
    advertise_address: str = Field(
        "", max_length=256, description="host:port other bridges and trainers reach this bridge at; empty = host:port."
    )
    key_prefix: str = Field("primerl:fleet", min_length=1, max_length=64, description="Prefix of every registry key.")
    heartbeat_s: float = Field(
        1.0, gt=0, le=60, description="How often a bridge re-registers (its record lives 3x this)."
    )
    poll_s: float = Field(
        0.1, gt=0, le=10, description="How often a bridge reads its model's record (version, update, replicas)."
    )
    check_each_turn: bool = Field(
        True,
        description="Read the model's fleet version (one Redis round trip) when each turn opens, so a bridge adopts a "
        "new version before its next token even between heartbeats; off: the heartbeat's read only.",
    )
    timeout_s: float = Field(0.5, gt=0, le=30, description="Timeout of each registry call.")
    update_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Longest a fleet-wide weight update may take (its pause expires after it)."
    )
    replica_backoff_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="A replica that fails is out fleet-wide this long, doubling each time it fails.",
    )
    episode_ttl_s: int = Field(3600, ge=10, description="An episode's owner record expires this long after it is set.")


class RegistryUnavailable(EngineUnavailable):
    """The registry's Redis could not be reached (UNAVAILABLE)."""


@dataclass(frozen=True)
class ReplicaRecord:
    """An engine replica of one model (SMG's ``/workers`` entry)."""

    url: str
    engine: str = ""
    kv_capacity_tokens: int = 0
    mig_profile: str = ""
    state: ReplicaState = "active"


@dataclass(frozen=True)
class BridgeRecord:
    """A live bridge, as its last heartbeat described it."""

    id: str
    address: str
    models: tuple[str, ...] = ()
    tenant: str = ""
    load: int = 0  # Steps in flight
    seen: float = 0.0  # wall clock of the heartbeat


@dataclass(frozen=True)
class Update:
    """A fleet-wide weight update in progress."""

    target: int
    token: str
    mode: str = "keep"


@dataclass(frozen=True)
class ModelRecord:
    """One model of the fleet: its policy version, weights, replicas, and the update running (if any)."""

    name: str
    version: int = 0
    weights: str = ""
    replicas: tuple[ReplicaRecord, ...] = ()
    update: Update | None = None
    down: tuple[tuple[str, float], ...] = ()  # (replica URL, unix time it stays out until): failed somewhere
    read_at: float = field(default=0.0, compare=False)  # monotonic clock of the read
    stamp: int = field(default=-1, compare=False)  # ``{p}:model:{m}:stamp`` when read (see ``FleetStore.stamp``)


def check_version(version: int) -> None:
    if not 0 <= version <= MAX_VERSION:
        raise InvalidArgument(f"policy_version must be in [0, {MAX_VERSION}] (int64), got {version}")


class FleetStore:
    """The registry in Redis (see module docstring); ``redis`` is a ``redis.asyncio.Redis``."""

    def __init__(self, redis: Any, config: FleetConfig) -> None:
        self.redis = redis
        self.config = config
        self.p = config.key_prefix

    @classmethod
    def connect(cls, url: str, config: FleetConfig) -> FleetStore:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        timeout = config.timeout_s  # no retries inside redis-py: a failed call fails open at once
        client = aioredis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, config)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        import redis.exceptions

        try:
            async with asyncio.timeout(self.config.timeout_s * 4):
                return await fn()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError, OSError) as exc:
            raise RegistryUnavailable(f"the fleet registry (Redis) is unreachable ({what}): {exc}") from exc

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    # -- models ---------------------------------------------------------------------------

    async def model(self, name: str) -> ModelRecord:
        """The model's record in one round trip."""

        async def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self._k("model", name))
            pipe.hgetall(self._k("model", name, "update"))
            pipe.hgetall(self._k("model", name, "replicas"))
            pipe.get(self._k("model", name, "stamp"))
            pipe.hgetall(self._k("model", name, "down"))
            return list(await pipe.execute())

        head, upd, reps, stamp, down = await self._call("read model", read)
        update = None
        if upd.get(b"target") and upd.get(b"token"):
            update = Update(int(upd[b"target"]), upd[b"token"].decode(), upd.get(b"mode", b"keep").decode())
        replicas = tuple(sorted((ReplicaRecord(**json.loads(v)) for v in reps.values()), key=lambda r: r.url))
        return ModelRecord(
            name,
            int(head.get(b"version", 0)),
            head.get(b"weights", b"").decode(),
            replicas,
            update,
            tuple(sorted((url.decode(), float(until)) for url, until in down.items())),
            time.monotonic(),
            int(stamp or 0),
        )

    async def mark_down(self, model: str, url: str, until: float) -> None:
        """Replica ``url`` failed: every bridge keeps it out of rotation until unix time ``until`` (its backoff)."""

        async def mark() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self._k("model", model, "down"), url, repr(until))
            self._bump(pipe, model)
            await pipe.execute()

        await self._call("mark replica down", mark)

    async def stamp(self, name: str) -> int:
        """A counter bumped by every write to the model's record (one GET: the cheap check before each turn)."""
        return int(await self._call("read stamp", lambda: self.redis.get(self._k("model", name, "stamp"))) or 0)

    def _bump(self, pipe: Any, name: str) -> None:
        pipe.incr(self._k("model", name, "stamp"))

    async def begin_update(self, name: str, target: int, mode: str) -> tuple[Update, int]:
        """Start an update of ``name`` to ``target`` (0 = current + 1); returns it and the current version.

        FAILED_PRECONDITION when another update of the model runs, INVALID_ARGUMENT when ``target`` is not
        greater than the current version."""
        import redis.exceptions

        token = secrets.token_hex(8)
        key, upd = self._k("model", name), self._k("model", name, "update")

        async def begin() -> tuple[Update, int]:
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key, upd)
                current = int(await pipe.hget(key, "version") or 0)
                running = await pipe.hget(upd, "target")
                if running is not None:
                    raise FailedPrecondition(
                        f"a fleet-wide weight update of {name!r} to version {int(running)} is running; retry after it"
                    )
                version = target or current + 1
                check_version(version)
                if version <= current:
                    raise InvalidArgument(
                        f"policy_version {version} must be greater than the fleet's current version {current}"
                    )
                pipe.multi()
                pipe.hset(upd, mapping={"target": version, "token": token, "mode": mode})
                self._bump(pipe, name)
                pipe.pexpire(upd, int(self.config.update_timeout_s * 1000))
                pipe.sadd(self._k("models"), name)
                await pipe.execute()
                return Update(version, token, mode), current

        try:
            return await self._call("begin update", begin)
        except redis.exceptions.WatchError:
            raise FailedPrecondition(f"another fleet-wide weight update of {name!r} began at the same time") from None

    async def commit_update(self, name: str, update: Update, weights: str) -> None:
        """Make ``update.target`` the fleet's version and end the update (the one place the version changes)."""
        import redis.exceptions

        key, upd = self._k("model", name), self._k("model", name, "update")

        async def commit() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key, upd)
                token = await pipe.hget(upd, "token")
                if token is None or token.decode() != update.token:
                    raise FailedPrecondition(
                        f"the fleet-wide update of {name!r} to version {update.target} expired "
                        f"(fleet.update_timeout_s = {self.config.update_timeout_s}) before it was committed"
                    )
                current = int(await pipe.hget(key, "version") or 0)
                if update.target <= current:
                    raise FailedPrecondition(f"the fleet of {name!r} is already at version {current}")
                pipe.multi()
                pipe.hset(key, mapping={"version": update.target, "weights": weights})
                pipe.delete(upd, self._k("model", name, "acks", str(update.target)))
                self._bump(pipe, name)
                await pipe.execute()

        try:
            await self._call("commit update", commit)
        except redis.exceptions.WatchError:
            raise FailedPrecondition(f"the fleet record of {name!r} changed during the commit") from None

    async def end_update(self, name: str, update: Update) -> None:
        """Give up an update (nothing was applied): admission resumes everywhere at the old version."""

        async def end() -> None:
            upd = self._k("model", name, "update")
            token = await self.redis.hget(upd, "token")
            if token is not None and token.decode() == update.token:
                await self.redis.delete(upd, self._k("model", name, "acks", str(update.target)))
                await self.redis.incr(self._k("model", name, "stamp"))

        await self._call("end update", end)

    async def ack(self, name: str, target: int, bridge_id: str) -> None:
        """``bridge_id`` paused and drained its turns of ``name`` for the update to ``target``."""

        async def ack() -> None:
            key = self._k("model", name, "acks", str(target))
            pipe = self.redis.pipeline(transaction=False)
            pipe.sadd(key, bridge_id)
            pipe.expire(key, int(self.config.update_timeout_s) + 1)
            await pipe.execute()

        await self._call("ack update", ack)

    async def acks(self, name: str, target: int) -> set[str]:
        key = self._k("model", name, "acks", str(target))
        members = await self._call("read acks", lambda: self.redis.smembers(key))
        return {m.decode() for m in members}

    # -- replicas ---------------------------------------------------------------------------

    async def put_replica(self, model: str, replica: ReplicaRecord) -> None:
        await self.put_replicas(model, [replica])

    async def put_replicas(self, model: str, replicas: list[ReplicaRecord]) -> None:
        """Write replicas in one transaction: a reader sees all of them or none (a bridge registering its list
        must never be seen half-registered, or another reader withdraws the replicas not yet written)."""
        for replica in replicas:
            if not replica.url.startswith(("http://", "https://")):
                raise InvalidArgument(f"replica URL {replica.url!r} must start with http:// or https://")

        async def put() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self._k("model", model, "replicas"), mapping={r.url: json.dumps(asdict(r)) for r in replicas})
            pipe.incr(self._k("model", model, "stamp"))
            pipe.sadd(self._k("models"), model)
            await pipe.execute()

        await self._call("write replica", put)

    async def replica(self, model: str, url: str) -> ReplicaRecord:
        raw = await self._call("read replica", lambda: self.redis.hget(self._k("model", model, "replicas"), url))
        if raw is None:
            raise NotFound(f"model {model!r} has no replica {url!r}")
        return ReplicaRecord(**json.loads(raw))

    async def remove_replica(self, model: str, url: str) -> None:
        async def remove() -> int:
            gone = int(await self.redis.hdel(self._k("model", model, "replicas"), url))
            await self.redis.incr(self._k("model", model, "stamp"))
            return gone

        gone = await self._call("remove replica", remove)
        if not gone:
            raise NotFound(f"model {model!r} has no replica {url!r}")

    async def models(self) -> list[str]:
        names = await self._call("list models", lambda: self.redis.smembers(self._k("models")))
        return sorted(m.decode() for m in names)

    # -- bridges ----------------------------------------------------------------------------

    async def heartbeat(self, bridge: BridgeRecord, ttl_s: float) -> None:
        async def beat() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self._k("bridge", bridge.id), json.dumps(asdict(bridge)), px=int(ttl_s * 1000))
            pipe.sadd(self._k("bridges"), bridge.id)
            await pipe.execute()

        await self._call("heartbeat", beat)

    async def leave(self, bridge_id: str) -> None:
        async def leave() -> None:
            await self.redis.delete(self._k("bridge", bridge_id))
            await self.redis.srem(self._k("bridges"), bridge_id)

        await self._call("leave", leave)

    async def bridges(self, model: str = "") -> list[BridgeRecord]:
        """The live bridges (of ``model``); ids whose heartbeat expired are dropped from the set."""

        async def read() -> list[BridgeRecord]:
            ids = sorted(i.decode() for i in await self.redis.smembers(self._k("bridges")))
            if not ids:
                return []
            raws = await self.redis.mget([self._k("bridge", i) for i in ids])
            dead = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if dead:
                await self.redis.srem(self._k("bridges"), *dead)
            out = []
            for raw in raws:
                if raw is not None:
                    d = json.loads(raw)
                    out.append(BridgeRecord(**{**d, "models": tuple(d["models"])}))
            return [b for b in out if not model or model in b.models]

        return await self._call("list bridges", read)

    # -- episodes ---------------------------------------------------------------------------

    async def own(self, episode_ids: list[str], address: str, holder: str = "") -> None:
        """Record ``address`` as the owner of the episodes; ``holder``: its episode-lease token (persistence),
        so a bridge that finds the owner dead can break the lease that owner held, and only that one."""

        async def own() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for e in episode_ids:
                pipe.set(self._k("episode", e), f"{address} {holder}".strip(), ex=self.config.episode_ttl_s)
            await pipe.execute()

        await self._call("own episode", own)

    async def owner(self, episode_id: str) -> tuple[str, str]:
        """(address, lease token) of the bridge that owns the episode (('', '') when no bridge does)."""
        raw = await self._call("find owner", lambda: self.redis.get(self._k("episode", episode_id)))
        address, _, holder = (raw.decode() if raw is not None else "").partition(" ")
        return address, holder

    async def disown(self, episode_id: str) -> None:
        await self._call("disown episode", lambda: self.redis.delete(self._k("episode", episode_id)))
