"""Global prefix cache: fingerprints (chained block hashes) and index backends (memory, Redis).

``make_index(config, redis_url)`` picks the backend; routing (placement/routing/) only
sees the ``PrefixIndex`` protocol.
"""

from __future__ import annotations

from cache.config import CacheConfig
from cache.fingerprint import Fingerprinter
from cache.index import IndexStats, Match, MemoryIndex, PrefixIndex

__all__ = ["CacheConfig", "Fingerprinter", "IndexStats", "Match", "MemoryIndex", "PrefixIndex", "make_index"]


def make_index(config: CacheConfig, redis_url: str = "") -> PrefixIndex:
    """The configured backend: Redis when asked (or ``auto`` with a URL), else in-process memory."""
    backend = config.backend
    if backend == "auto":
        backend = "redis" if redis_url else "memory"
    if backend == "redis":
        if not redis_url:
            raise ValueError("cache.backend = 'redis' needs redis.url")
        from cache.redis_index import RedisIndex  # redis-py is only imported when used

        return RedisIndex(redis_url, config)
    return MemoryIndex(
        config.block_size,
        capacity=config.default_capacity_blocks,
        eviction=config.eviction,
        provisional_ttl_s=config.provisional_ttl_s,
        ghost_ttl_s=config.ghost_ttl_s,
        capacity_ratio=config.capacity_ratio,
    )
