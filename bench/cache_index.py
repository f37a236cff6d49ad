"""Prefix-index lookup latency and memory against a real (private) redis-server.

Measures, for a 4k-token prompt (256 blocks of 16): lookup p50/p99 when every block is held
(the worst case: the walk cannot stop early), when the first block misses, and with the
near-cache warm; and the Redis bytes per indexed (block, replica) entry, as the used_memory
delta of the fill and as the MEMORY USAGE of the index's keys. Targets: p99 <= 2 ms, <= 40 B
per entry (issue 24).

    .venv/bin/python bench/cache_index.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import pct, record
from cache import CacheConfig, Fingerprinter
from cache.redis_index import RedisIndex
from core.salt import CacheSalt
from tests.integration.redis_proc import PrivateRedis

PROMPT = 4096
BLOCK = 16
CHAINS = 200  # prompts indexed, each on replica k % 8 and its first 64 blocks also on replica (k + 1) % 8
CAPACITY = 8192  # per-replica bound (each replica holds 8,000 entries)
BUCKETS = 1024  # block-record hash keys: 51,200 blocks / 64, rounded up to a power of two


async def timed(idx: RedisIndex, hashes: list[int], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        m = await idx.lookup(hashes)
        out.append((time.perf_counter() - t0) * 1e3)
        if not m.ok:
            raise RuntimeError("lookup failed open during the benchmark")
    return out


async def _script_ms(idx: RedisIndex) -> float:
    stats = await idx.redis.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan"))) / 1e3


async def _evicting_writes(url: str, cfg: CacheConfig, fp: Fingerprinter, rng: random.Random, salt: str) -> float:
    """Redis time per 256-block record on a replica at its bound (each write evicts 256 entries)."""
    idx = RedisIndex(url, cfg.model_copy(update={"default_capacity_blocks": 2048, "key_prefix": "bench:evict"}))
    for i in range(24):
        if i == 12:
            await idx.redis.config_resetstat()
        await idx.record(0, fp.hashes([rng.randrange(49152) for _ in range(PROMPT)], salt))
        await idx.flush()
    out = await _script_ms(idx)
    await idx.close()
    return out


async def main(iters: int) -> None:
    server = PrivateRedis()
    server.start()
    try:
        fp = Fingerprinter(block_size=BLOCK)
        rng = random.Random(0)
        salt = str(CacheSalt("smollm2", 1))
        # Budget lifted so slow outliers are measured instead of failing open. The index is sized as
        # documented for this fleet: each replica's bound just above what it holds (8,000 entries, no
        # eviction), the block records spread over ~ blocks / 64 hash keys.
        cold = CacheConfig(
            block_size=BLOCK,
            lookup_budget_ms=1000,
            near_cache_ttl_s=0,
            default_capacity_blocks=CAPACITY,
            index_buckets=BUCKETS,
            write_timeout_ms=5000,
        )
        idx = RedisIndex(server.url, cold)
        info0 = await idx.redis.info("memory")
        await idx.redis.config_resetstat()
        chains = [fp.hashes([rng.randrange(49152) for _ in range(PROMPT)], salt) for _ in range(CHAINS)]
        for k, chain in enumerate(chains):
            await idx.confirm(k % 8, chain)
            await idx.confirm((k + 1) % 8, chain[:64])  # a second holder of the first 1k tokens
            await idx.flush()
        await idx.flush()
        write_ms = await _script_ms(idx)  # per 256- or 64-block confirm, nothing evicted
        entries = sum(len(c) + 64 for c in chains)
        info1 = await idx.redis.info("memory")
        bytes_per_entry = (info1["used_memory"] - info0["used_memory"]) / entries
        keys = await idx.redis.dbsize()
        usage = 0  # what MEMORY USAGE charges the index's keys (exact: samples 0), encodings by key
        encodings: dict[str, int] = {}
        async for key in idx.redis.scan_iter(count=1000):
            usage += await idx.redis.memory_usage(key, samples=0) or 0
            enc = (await idx.redis.object("encoding", key)).decode()
            encodings[enc] = encodings.get(enc, 0) + 1
        usage_per_entry = usage / entries

        hit = chains[7]
        miss = fp.hashes([rng.randrange(49152) for _ in range(PROMPT)], salt)
        await timed(idx, hit, 50)  # warm the connection and the script cache
        trips0 = idx.stats.round_trips
        await idx.redis.config_resetstat()
        full = await timed(idx, hit, iters)
        stats = await idx.redis.info("commandstats")
        server_us = float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan")))
        first_miss = await timed(idx, miss, iters)
        trips = idx.stats.round_trips - trips0
        await idx.close()

        pipe_idx = RedisIndex(server.url, cold.model_copy(update={"lookup_mode": "pipeline"}))
        await timed(pipe_idx, hit, 20)
        pipelined = await timed(pipe_idx, hit, max(100, iters // 10))
        await pipe_idx.close()

        near_idx = RedisIndex(server.url, cold.model_copy(update={"near_cache_ttl_s": 1.0}))
        await timed(near_idx, hit, 1)
        near = await timed(near_idx, hit, iters)
        await near_idx.close()
        evict_ms = await _evicting_writes(server.url, cold, fp, rng, salt)
    finally:
        server.close()

    rows = [
        ("lookup, 4k tokens all held: p50 / p99", f"{pct(full, 50):.3f} / {pct(full, 99):.3f} ms", "p99 <= 2 ms"),
        ("Redis server time per full-hit lookup (Lua walk)", f"{server_us / 1e3:.3f} ms", ""),
        ("lookup, first block misses: p50 / p99", f"{pct(first_miss, 50):.3f} / {pct(first_miss, 99):.3f} ms", ""),
        (
            "same, pipeline mode (chunked HGET): p50 / p99",
            f"{pct(pipelined, 50):.3f} / {pct(pipelined, 99):.3f} ms",
            "",
        ),
        ("lookup, near-cache warm: p50 / p99", f"{pct(near, 50):.3f} / {pct(near, 99):.3f} ms", ""),
        ("Redis round trips per lookup (script mode)", f"{trips / (2 * iters):.2f}", ""),
        (
            "Redis server time per write: 256/64-block confirm / 256-block record evicting 256",
            f"{write_ms:.3f} / {evict_ms:.3f} ms",
            "",
        ),
        ("Redis bytes per indexed (block, replica) entry (used_memory delta)", f"{bytes_per_entry:.1f} B", "<= 40 B"),
        ("same, MEMORY USAGE of the index's keys", f"{usage_per_entry:.1f} B", "<= 40 B"),
        (
            "entries / blocks / keys (encodings)",
            f"{entries} / {CHAINS * PROMPT // BLOCK} / {keys} ({', '.join(f'{n} {e}' for e, n in encodings.items())})",
            "",
        ),
    ]
    figures = {
        "full_p50_ms": pct(full, 50),
        "full_p99_ms": pct(full, 99),
        "miss_p50_ms": pct(first_miss, 50),
        "miss_p99_ms": pct(first_miss, 99),
        "near_p50_ms": pct(near, 50),
        "near_p99_ms": pct(near, 99),
        "pipeline_p50_ms": pct(pipelined, 50),
        "pipeline_p99_ms": pct(pipelined, 99),
        "bytes_per_entry": bytes_per_entry,
        "memory_usage_per_entry": usage_per_entry,
        "encodings": encodings,
        "server_ms_per_lookup": server_us / 1e3,
        "server_ms_per_write": write_ms,
        "server_ms_per_evicting_write": evict_ms,
        "iters": iters,
    }
    record(
        "cache_index",
        "Prefix index lookups against real Redis (4k-token prompt, 256 blocks of 16)",
        rows,
        figures,
        notes="redis-server 7 on 127.0.0.1 (private, no persistence), redis-py asyncio. Script mode = one Lua walk "
        "that stops at the first miss (the default); pipeline mode = HGET chunks of 32/128/512. Layout: packed "
        "block records in listpack hashes (index_buckets = 1,024 for 51,200 blocks) and per-replica eviction "
        f"scores in listpack sorted sets (bound {CAPACITY} blocks per replica), cache/redis_index.py. The "
        "machine's 2 cores are shared with other jobs, so p99 includes scheduler noise.",
        ratios={
            # a first-block miss is one round trip and a one-step walk: the same-run floor of a lookup
            "full_hit_over_miss_p50": pct(full, 50) / pct(first_miss, 50),
            "round_trips_per_lookup": trips / (2 * iters),
            "bytes_per_entry": bytes_per_entry,
        },
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    asyncio.run(main(ap.parse_args().iters))
