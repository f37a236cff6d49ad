"""Configuration of the prefix-cache index (``Settings.cache``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CacheConfig(BaseModel):
    """Global prefix-cache index shared by routing (see cache/index.py, cache/redis_index.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Keep a prefix index for cache-aware routing; off = load-only routing.")
    backend: Literal["auto", "memory", "redis"] = Field(
        "auto", description="Index backend: auto = Redis when redis.url is set, else in-process memory."
    )
    block_size: int = Field(16, ge=1, le=4096, description="Tokens per hashed block; must equal the engine's KV block.")
    hash_algo: Literal["xxh3_64", "blake2b"] = Field(
        "xxh3_64", description="Block hash; every bridge sharing one index must use the same one."
    )
    eviction: Literal["cost", "lru"] = Field(
        "cost",
        description="Index eviction: cost = GDSF-style (reuse per copy, aged by capacity turnovers, parents "
        "outlive children; cache/index.py); lru baseline.",
    )
    ghost_ttl_s: float = Field(
        600.0, gt=0, description="Cost eviction: how long a block's reuse count outlives its last index entry."
    )
    capacity_blocks: int = Field(
        0, ge=0, description="Indexed blocks per replica; 0 = the replica's KV capacity / block_size x capacity_ratio."
    )
    capacity_ratio: float = Field(
        1.0,
        gt=0,
        le=4,
        description="Index bound as a fraction of the replica's KV capacity (when derived); cost "
        "eviction keeps a reused entry at most 1 / ratio index turnovers (the engine's LRU horizon).",
    )
    default_capacity_blocks: int = Field(
        31250, ge=1, description="Per-replica bound when the engine reports no KV capacity (llm-d's default)."
    )
    lookup_budget_ms: float = Field(
        2.0, gt=0, le=1000, description="A lookup slower than this fails open to load-only routing (counted)."
    )
    write_timeout_ms: float = Field(50.0, gt=0, le=10000, description="Timeout of one background index write.")
    event_write_timeout_ms: float = Field(
        2000.0,
        gt=0,
        le=60000,
        description="Timeout of one index write from a replica's KV events (awaited and retried once, never "
        "skipped: a lost event write would leave the exact index wrong, so the replica's entries are dropped).",
    )
    event_settle_ms: float = Field(
        50.0,
        ge=0,
        le=10000,
        description="Before a routing decision, wait at most this long for the KV events that have reached the "
        "bridge to be applied, so a session's next turn sees the blocks its last one stored; 0 = do not wait.",
    )
    lookup_mode: Literal["script", "pipeline"] = Field(
        "script",
        description="Redis lookup: script = one server-side walk (Lua) per lookup; pipeline = chunked HGETALLs.",
    )
    near_cache_ttl_s: float = Field(
        0.5, ge=0, le=10, description="How long a bridge reuses a lookup answer read from Redis; 0 disables."
    )
    near_cache_entries: int = Field(65536, ge=0, description="Blocks kept in the local near-cache at most.")
    provisional_ttl_s: float = Field(
        30.0, gt=0, description="Seconds a routing-time (provisional) entry lives unless an engine report confirms it."
    )
    affinity_ttl_s: float = Field(
        3600.0, gt=0, description="Lifetime of episode and GRPO-group replica pins shared through the index."
    )
    backoff_s: float = Field(
        0.5, ge=0, le=60, description="After a Redis error, skip Redis (fail open) for this long before retrying."
    )
    max_lookup_blocks: int = Field(8192, ge=1, description="Blocks looked up per request at most (longer tails miss).")
    key_prefix: str = Field("primerl:pfx", min_length=1, description="Prefix of every Redis key of the index.")
    index_buckets: int = Field(
        4096,
        ge=1,
        le=65536,
        description="Redis index: hash keys the block records are spread over (a power of two, about the "
        "fleet's indexed blocks / 64, so each stays a compact listpack); bridges with another value "
        "do not see each other's blocks.",
    )

    @field_validator("index_buckets")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"index_buckets must be a power of two, got {v}")
        return v

    def namespace(self) -> str:
        """Key namespace: bridges with another hash or block size never read each other's entries."""
        return f"{self.key_prefix}:{self.hash_algo}:{self.block_size}"

    def capacity_for(self, kv_capacity_tokens: int) -> int:
        """Per-replica bound in blocks for a replica holding ``kv_capacity_tokens`` of KV (0 = unknown)."""
        if self.capacity_blocks:
            return self.capacity_blocks
        if kv_capacity_tokens <= 0:
            return self.default_capacity_blocks
        return max(1, int(kv_capacity_tokens / self.block_size * self.capacity_ratio))
