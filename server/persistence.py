"""Episode persistence in Redis (opt-in): a restarted bridge, or another bridge on the same Redis, resumes episodes.

Invariants
----------
* Records are written at turn boundaries only: after StartEpisode, after each Step (its turn closed), and
  deleted only after EndEpisode has built the trajectory. A record is one Redis hash (``rev``, ``data``) written
  in one MULTI/EXEC transaction, so a reader sees a whole episode or the previous one, never half of it.
* Every record carries ``rev`` (incremented per write). A bridge reloads an episode when it does not hold it or
  holds an older revision, so turns sent alternately through two bridges see one history.
* A Step holds a lease on its episode (``SET NX PX``, owner token) across bridges; a second Step anywhere gets
  FAILED_PRECONDITION. A lease expires on its own if its bridge dies (``lease_ms``); a crashed bridge worker's
  leases are dropped by the worker that replaces it, as it starts (``break_leases_of``).
* Token arrays are stored as raw little-endian bytes (int32 ids, float64 logprobs, int8 origins, int64
  versions): a round trip is bit-exact, NaNs included.
* Every Redis call has a timeout; errors surface as :class:`PersistenceUnavailable` and the bridge decides
  (``persistence.required``) whether that fails the RPC or is logged and counted (fail open).
"""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.types import FinishReason, SamplingParams, Usage
from server.episodes import Episode, Turn
from server.errors import EngineUnavailable

FORMAT = 1
_ARRAYS: dict[str, str] = {
    "token_ids": "<i4",
    "logprobs": "<f8",
    "raw_logprobs": "<f8",
    "kept_logmass": "<f8",
    "origins": "i1",
    "versions": "<i8",
}


class PersistenceConfig(BaseModel):
    """Durable episodes in the Redis at ``redis.url``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write open episodes to Redis at turn boundaries and resume them.")
    required: bool = Field(
        False,
        description="Fail RPCs with UNAVAILABLE when Redis cannot be written; off: log, count and go on in memory.",
    )
    key_prefix: str = Field("primerl", min_length=1, max_length=64, description="Prefix of every key written.")
    ttl_s: int = Field(7 * 86400, ge=60, description="Idle episodes expire from Redis after this long.")
    lease_ms: int = Field(
        900_000, ge=1000, description="Longest a Step may hold its episode; a crashed bridge's lease expires."
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="Timeout of each Redis call.")


class PersistenceUnavailable(EngineUnavailable):
    """Redis could not be read or written."""


def _pack(values: list[Any], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def _unpack(data: str, dtype: str) -> list[Any]:
    values: list[Any] = np.frombuffer(base64.b64decode(data), dtype=dtype).tolist()
    return values


def encode(episode: Episode, rev: int) -> bytes:
    """One episode as a self-contained record (JSON with packed arrays)."""
    turns = [
        {
            "index": t.index,
            "observation_start": t.observation_start,
            "generation_start": t.generation_start,
            "end": t.end,
            "policy_version": t.policy_version,
            "finish_reason": int(t.finish_reason) if t.finish_reason is not None else None,
            "usage": asdict(t.usage),
            "latency_ms": t.latency_ms,
            "ttft_ms": t.ttft_ms,
        }
        for t in episode.turns
    ]
    record = {
        "format": FORMAT,
        "rev": rev,
        "id": episode.id,
        "tenant": episode.tenant,
        "model": episode.model,
        "group_id": episode.group_id,
        "group_index": episode.group_index,
        "replica": episode.replica,
        "sampling": {**asdict(episode.sampling), "stop_token_ids": list(episode.sampling.stop_token_ids)},
        "metadata": episode.metadata,
        "prompt_length": episode.prompt_length,
        "shares_prompt": episode.shares_prompt,
        "tool_schemas": list(episode.tool_schemas),
        "adapter": episode.adapter,
        "turns": turns,
        **{name: _pack(getattr(episode, name), dtype) for name, dtype in _ARRAYS.items()},
    }
    return json.dumps(record, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple[Episode, int]:
    """Inverse of :func:`encode`; returns the episode and its revision."""
    r = json.loads(data)
    if r.get("format") != FORMAT:
        raise ValueError(f"unsupported episode record format {r.get('format')!r}")
    sampling = r["sampling"]
    sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    episode = Episode(
        id=r["id"],
        tenant=r["tenant"],
        model=r["model"],
        group_id=r["group_id"],
        group_index=r["group_index"],
        replica=r["replica"],
        sampling=SamplingParams(**sampling),
        metadata=r["metadata"],
        prompt_length=r["prompt_length"],
        shares_prompt=r["shares_prompt"],
        tool_schemas=tuple(r.get("tool_schemas", ())),
        adapter=r.get("adapter", ""),
        turns=[
            Turn(
                index=t["index"],
                observation_start=t["observation_start"],
                generation_start=t["generation_start"],
                end=t["end"],
                policy_version=t["policy_version"],
                finish_reason=FinishReason(t["finish_reason"]) if t["finish_reason"] is not None else None,
                usage=Usage(**t["usage"]),
                latency_ms=t["latency_ms"],
                ttft_ms=t["ttft_ms"],
            )
            for t in r["turns"]
        ],
    )
    for name, dtype in _ARRAYS.items():  # a record written before a field existed: NaN (not asked for)
        setattr(episode, name, _unpack(r[name], dtype) if name in r else [math.nan] * len(episode.token_ids))
    return episode, int(r["rev"])


# Delete the lease KEYS[1] only while one of ARGV (owner tokens) holds it, in one step (pcall: a key of another
# type under the lease prefix reads as not held, instead of failing the call).
_DELETE_IF_HELD_BY = """
local holder = redis.pcall('get', KEYS[1])
for _, token in ipairs(ARGV) do
  if holder == token then return redis.call('del', KEYS[1]) end
end
return 0
"""
SCAN_COUNT = 10_000  # keys SCAN walks per call: a million-key Redis (the prefix index shares it) is ~100 calls


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class EpisodeJournal:
    """Episode records and Step leases in Redis."""

    def __init__(self, url: str, config: PersistenceConfig, owner: str = "") -> None:
        import redis.asyncio as aioredis

        self.config = config
        self.owner = owner or secrets.token_hex(8)  # this bridge process, for leases (a worker's: set by its parent)
        self._redis = aioredis.from_url(
            url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s, retry_on_timeout=False
        )
        self._prefix = config.key_prefix

    @property
    def client(self) -> Any:
        """The Redis client (the inspector keeps its ended episodes through it: same Redis, prefix, timeouts)."""
        return self._redis

    def _key(self, kind: str, episode_id: str) -> str:
        return f"{self._prefix}:{kind}:{episode_id}"

    async def _call(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise PersistenceUnavailable(f"episode persistence: cannot {what} in Redis: {exc}") from None

    async def save(self, episode: Episode, rev: int) -> None:
        key = self._key("ep", episode.id)
        async with self._redis.pipeline(transaction=True) as tx:
            tx.hset(key, mapping={"rev": rev, "data": encode(episode, rev)})
            tx.expire(key, self.config.ttl_s)
            await self._call("write the episode", tx.execute())

    async def load(self, episode_id: str) -> tuple[Episode, int] | None:
        data = await self._call("read the episode", self._redis.hget(self._key("ep", episode_id), "data"))
        return decode(data) if data is not None else None

    async def revision(self, episode_id: str) -> int | None:
        """The stored revision, without transferring the record's arrays."""
        rev = await self._call("read the revision", self._redis.hget(self._key("ep", episode_id), "rev"))
        return None if rev is None else int(rev)

    async def delete(self, episode_id: str) -> None:
        """Delete the record and leave a tombstone, so other bridges drop their copies (and a Redis that
        merely lost its data is not mistaken for an ended episode)."""
        async with self._redis.pipeline(transaction=True) as tx:
            tx.delete(self._key("ep", episode_id))
            tx.set(self._key("ended", episode_id), 1, ex=self.config.ttl_s)
            await self._call("delete the episode", tx.execute())

    async def ended(self, episode_id: str) -> bool:
        """Whether the episode was ended (through any bridge) within the record TTL."""
        return bool(await self._call("read the tombstone", self._redis.exists(self._key("ended", episode_id))))

    async def open_ids(self) -> list[str]:
        keys: list[str] = []
        cursor = 0
        pattern = _glob_escape(self._key("ep", "")) + "*"
        while True:
            cursor, batch = await self._call("list episodes", self._redis.scan(cursor, match=pattern, count=500))
            keys += [k.decode() if isinstance(k, bytes) else k for k in batch]
            if cursor == 0:
                return [k.rsplit(":", 1)[1] for k in keys]

    async def acquire(self, episode_id: str) -> bool:
        """Take the Step lease of an episode; False if another Step (anywhere) holds it."""
        key = self._key("lease", episode_id)
        ok = await self._call("lease the episode", self._redis.set(key, self.owner, nx=True, px=self.config.lease_ms))
        return bool(ok)

    async def release(self, episode_id: str) -> None:
        """Drop our lease (only ours: a compare-and-delete in one script)."""
        key = self._key("lease", episode_id)
        await self._call("release the lease", self._redis.eval(_DELETE_IF_HELD_BY, 1, key, self.owner))

    async def break_lease(self, episode_id: str, holder: str) -> bool:
        """Drop the lease ``holder`` (another bridge's ``owner``) holds, when that bridge is known dead (the fleet
        router found it unreachable); compare-and-delete, so a lease a live bridge took since is kept."""
        key = self._key("lease", episode_id)
        return bool(
            await self._call("break a dead bridge's lease", self._redis.eval(_DELETE_IF_HELD_BY, 1, key, holder))
        )

    async def break_leases_of(self, holders: Sequence[str]) -> int:
        """Drop every lease one of ``holders`` holds (bridge processes known dead: the crashed predecessors of a
        bridge worker, for the worker that replaces them); how many were dropped. Called once, when that worker
        starts: one SCAN pass over the keyspace (SCAN walks every key and filters after, so a Redis shared with a
        large prefix index costs ~100 calls per million keys), each lease compare-and-deleted, so a lease a live
        process took since is kept."""
        if not holders:
            return 0
        dropped, cursor = 0, 0
        pattern = _glob_escape(self._key("lease", "")) + "*"
        while True:
            scan = self._redis.scan(cursor, match=pattern, count=SCAN_COUNT)
            cursor, keys = await self._call("list leases", scan)
            for key in keys:
                drop = self._redis.eval(_DELETE_IF_HELD_BY, 1, key, *holders)
                dropped += int(await self._call("break a dead bridge's lease", drop))
            if cursor == 0:
                return dropped

    async def close(self) -> None:
        await self._redis.aclose()
