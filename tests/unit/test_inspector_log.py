"""The inspector's event hub and episode log without sockets: a slow page drops the oldest events and is told so,
never blocking the publisher; reconnects resume from the ring or are told to refetch; each subscriber sees its
tenant's events only; the ended-episode memory is bounded by count and bytes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from core.types import Origin, SamplingParams
from server.episodes import Episode
from server.inspector import EpisodeLog, EventHub, InspectorConfig
from server.inspector import store as store_module
from server.inspector.log import load_ended
from server.inspector.store import EndedStore


def _episode(i: int, tenant: str = "t", tokens: int = 50) -> Episode:
    ep = Episode(f"ep-{i}", tenant, "toy", "g", 0, 0, SamplingParams(), {})
    ep.append_unsampled(list(range(tokens)), Origin.PROMPT, 0)
    return ep


async def test_a_slow_subscriber_loses_the_oldest_and_is_told_how_many() -> None:
    hub = EventHub(queue_size=8)
    slow, other = hub.subscribe("alice"), hub.subscribe("bob")
    for i in range(20):
        hub.publish("step_ended", "alice", {"n": i})  # never waits, however slow the page
    hub.publish("weights_updated", None, {"version": 1})  # no tenant: everyone's
    batch = await slow.wait(0.1)
    assert [e.data.get("n") for e in batch] == [13, 14, 15, 16, 17, 18, 19, None]
    assert slow.take_dropped() == 13 and slow.take_dropped() == 0
    assert [e.kind for e in await other.wait(0.1)] == ["weights_updated"]
    assert await other.wait(0.01) == []  # a heartbeat's timeout
    hub.close()
    assert slow.closed and await slow.wait(5) == []  # closed: returns at once


def test_a_reconnect_resumes_from_the_ring_or_is_told_to_refetch() -> None:
    hub = EventHub(queue_size=8, history=4)
    for i in range(3):
        hub.publish("step_ended", "alice" if i != 1 else "bob", {"n": i})
    first = hub.event_id(hub.since(f"{hub.boot}-0", None)[0])  # type: ignore[index]
    assert [e.data["n"] for e in hub.since(first, "alice") or []] == [2]
    assert hub.since("another-process-1", None) is None
    for i in range(3, 10):
        hub.publish("step_ended", "alice", {"n": i})
    assert hub.since(first, None) is None  # fell off the ring: refetch everything


def test_ended_episodes_are_evicted_oldest_first_by_count_and_by_bytes() -> None:
    log = EpisodeLog(InspectorConfig(max_ended_episodes=3))
    for i in range(5):
        log.ended(_episode(i), [1.0], [], 5.0, discarded=False)
    assert [k for k, _ in log.ended_entries()] == ["ep-4", "ep-3", "ep-2"] and log.evicted == 2
    summary, episode = load_ended(log.ended_entry("ep-4"))  # type: ignore[arg-type]
    assert summary["status"] == "ended" and summary["rewards"] == [1.0] and episode.token_ids == list(range(50))
    one = next(iter(log.ended_entries()))[1].size
    by_bytes = EpisodeLog(InspectorConfig(max_ended_bytes=int(one * 2.5)))
    for i in range(6):
        by_bytes.ended(_episode(i), [], [], 1.0, discarded=i == 5)
    assert by_bytes.ended_count == 2 and by_bytes.ended_bytes <= one * 2.5 and by_bytes.evicted == 4
    off = EpisodeLog(InspectorConfig(enabled=False))
    off.ended(_episode(0), [], [], 1.0, discarded=False)
    assert off.ended_count == 0 and len(off.hub) == 0


def test_weight_updates_record_the_pause_they_ran_in() -> None:
    log = EpisodeLog(InspectorConfig())
    log.weights_updated(0, 1, 100.0, 0.02)
    log.paused()
    log.weights_updated(1, 2, 101.0, 0.03)
    time.sleep(0.02)
    log.resumed()
    first, second = log.updates
    assert first["in_pause"] is False and first["paused_ms"] is None and first["duration_ms"] == 20.0
    assert second["in_pause"] is True and second["paused_ms"] >= 20 and log.paused_since is None


class _HungRedis:
    """A Redis that never answers: every pipelined write waits forever."""

    def pipeline(self, transaction: bool = False) -> _HungRedis:
        return self

    async def __aenter__(self) -> _HungRedis:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    async def execute(self) -> None:
        await asyncio.sleep(3600)


async def test_ended_episodes_go_to_redis_without_waiting_and_a_hung_redis_drops_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_module, "QUEUE", 2)
    store = EndedStore(_HungRedis(), "p", ttl_s=60, keep=10, timeout_s=0.1)
    log = EpisodeLog(InspectorConfig(), store)
    began = time.perf_counter()
    for i in range(5):
        log.ended(_episode(i), [1.0], [], 1.0, False)  # the hook never waits on Redis
    assert time.perf_counter() - began < 0.05 and log.ended_count == 5
    assert store.dropped >= 2  # the bounded queue was full: dropped and counted
    await asyncio.sleep(0.3)  # the writer's batch timed out: dropped too
    assert store.dropped == 5
    began = time.perf_counter()
    await log.close_store()  # bounded, however hung Redis is
    assert time.perf_counter() - began < 0.5
    log.ended(_episode(9), [], [], 1.0, False)  # after close: kept in memory only, nothing raised
    assert log.ended_count == 6
