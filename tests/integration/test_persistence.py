"""Episode records in a private Redis: bit-exact round trips, revisions, Step leases, Redis failures."""

from __future__ import annotations

import math

import pytest

from core.types import FinishReason, Origin, SamplingParams, Usage
from server.episodes import Episode, Turn
from server.persistence import EpisodeJournal, PersistenceConfig, PersistenceUnavailable, decode, encode
from tests.integration.redis_proc import PrivateRedis


def _episode() -> Episode:
    ep = Episode(
        id="ep-" + "ab" * 16,
        tenant="alice",
        model="toy",
        group_id="grp-1",
        group_index=3,
        replica=1,
        sampling=SamplingParams(temperature=0.7, top_k=5, max_tokens=9, stop_token_ids=(2, 7), seed=2**63 - 1),
        metadata={"task": "x"},
        shares_prompt=True,
    )
    ep.append_unsampled([1, 4, 30], Origin.PROMPT, 0)
    ep.prompt_length = 3
    ep.append([11, 12], [-0.1234567890123, -2.5e-12], [Origin.SAMPLED] * 2, 4, [-0.2, -3.0])
    ep.turns.append(Turn(0, 3, 3, 5, 4, FinishReason.STOP, Usage(3, 0, 2), latency_ms=1.5, ttft_ms=0.5))
    return ep


def test_record_round_trip_is_bit_exact() -> None:
    ep = _episode()
    back, rev = decode(encode(ep, 7))
    assert rev == 7
    for name in ("id", "tenant", "model", "group_id", "group_index", "replica", "sampling", "metadata"):
        assert getattr(back, name) == getattr(ep, name), name
    assert back.token_ids == ep.token_ids and back.origins == ep.origins and back.versions == ep.versions
    assert back.logprobs[3:] == ep.logprobs[3:] and all(math.isnan(x) for x in back.logprobs[:3])
    assert back.raw_logprobs[3:] == [-0.2, -3.0]
    assert back.turns[0].finish_reason is FinishReason.STOP and back.turns[0].usage == Usage(3, 0, 2)
    assert back.loss_mask == ep.loss_mask and back.shares_prompt and back.prompt_length == 3


async def test_journal_saves_loads_leases_and_lists(redis_server: PrivateRedis) -> None:
    journal = EpisodeJournal(redis_server.url, PersistenceConfig(enabled=True, key_prefix="t1"))
    other = EpisodeJournal(redis_server.url, PersistenceConfig(enabled=True, key_prefix="t1"))
    try:
        ep = _episode()
        assert await journal.load(ep.id) is None
        await journal.save(ep, 1)
        ep.append([13], [-0.5], [Origin.SAMPLED], 4)
        await journal.save(ep, 2)
        assert await other.revision(ep.id) == 2
        loaded = await other.load(ep.id)
        assert loaded is not None and loaded[0].token_ids == ep.token_ids
        assert await journal.open_ids() == [ep.id]

        assert await journal.acquire(ep.id)
        assert not await other.acquire(ep.id)  # one Step at a time, across bridges
        await other.release(ep.id)  # not its lease: no effect
        assert not await other.acquire(ep.id)
        await journal.release(ep.id)
        assert await other.acquire(ep.id)

        await journal.delete(ep.id)
        assert await journal.load(ep.id) is None and await journal.open_ids() == []
    finally:
        await journal.close()
        await other.close()


async def test_a_dead_processs_leases_are_dropped_and_no_others(redis_server: PrivateRedis) -> None:
    """``break_leases_of``: every lease the dead tokens hold goes, a live process's stay; the key prefix is
    matched literally (glob characters in it), and a key of another type under the lease prefix is skipped."""
    import redis.asyncio as aioredis

    config = PersistenceConfig(enabled=True, key_prefix="t[3]")
    owners = ("w1-dead", "w1-dead-too", "w0-live", "w1-new")
    dead, dead_too, live, heir = (EpisodeJournal(redis_server.url, config, owner) for owner in owners)
    raw = aioredis.from_url(redis_server.url)
    try:
        assert await dead.acquire("ep-a") and await dead.acquire("ep-b") and await dead_too.acquire("ep-c")
        assert await live.acquire("ep-d")
        await raw.hset("t[3]:lease:not-a-lease", "x", 1)
        await raw.set("t3:lease:ep-e", "w1-dead")  # another prefix (what an unescaped "t[3]" would match)
        assert await heir.break_leases_of(["w1-dead-too", "w1-dead"]) == 3
        assert await heir.break_leases_of(["w1-dead"]) == 0
        assert all([await heir.acquire(ep) for ep in ("ep-a", "ep-b", "ep-c")])
        assert not await heir.acquire("ep-d")  # still the live process's
        assert await heir.break_leases_of(["w0-live-other"]) == 0 and not await dead.acquire("ep-d")
        assert await raw.get("t3:lease:ep-e") == b"w1-dead"
    finally:
        for journal in (dead, dead_too, live, heir):
            await journal.close()
        await raw.aclose()


async def test_redis_down_is_a_clear_persistence_error(redis_server: PrivateRedis) -> None:
    journal = EpisodeJournal(redis_server.url, PersistenceConfig(enabled=True, timeout_s=0.5))
    try:
        await journal.save(_episode(), 1)
        redis_server.kill()
        with pytest.raises(PersistenceUnavailable, match="cannot read the episode in Redis"):
            await journal.load(_episode().id)
        redis_server.start()  # same port, empty (no persistence in the test server)
        assert await journal.load(_episode().id) is None
    finally:
        await journal.close()
