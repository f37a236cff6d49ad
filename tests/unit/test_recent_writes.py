"""RecentWrites: a bridge's own routing writes count in answers asked before they reached Redis, and only there."""

from __future__ import annotations

from cache.index import Match
from cache.recent import RecentWrites


def writes() -> tuple[RecentWrites, list[float]]:
    now = [100.0]
    return RecentWrites(horizon_ms=50, clock_ms=lambda: now[0]), now


def test_an_answer_asked_before_a_write_landed_is_continued_through_it() -> None:
    w, now = writes()
    asked = Match({}, True, 0, asked_ms=now[0])
    w.begin(0, [1, 2, 3])
    assert w.extend(asked, [1, 2, 3, 4]).blocks == {0: 3}  # in flight
    now[0] = 110.0
    w.landed(0, [1, 2, 3])
    assert w.extend(asked, [1, 2, 3, 4]).blocks == {0: 3}  # landed after it was asked
    later = Match({}, True, 0, asked_ms=120.0)  # Redis answered after the landing: it knows better (an eviction)
    assert w.extend(later, [1, 2, 3, 4]) is later


def test_a_chain_continues_only_where_the_answer_ends_and_without_gaps() -> None:
    w, now = writes()
    w.begin(1, [2, 3])
    redis_had_one = Match({1: 1, 0: 4}, True, 4, asked_ms=now[0])
    assert w.extend(redis_had_one, [1, 2, 3, 4]).blocks == {1: 3, 0: 4}
    w.begin(2, [3])  # block 2 unknown on replica 2: nothing after the gap counts
    assert 2 not in w.extend(Match({}, True, 0, asked_ms=now[0]), [1, 2, 3]).blocks
    assert w.extend(Match(ok=False), [1, 2, 3]).ok is False  # a failed-open lookup stays failed open


def test_evictions_drops_and_a_forgotten_replica_remove_them_at_once() -> None:
    w, now = writes()
    asked = Match({}, True, 0, asked_ms=now[0])
    w.begin(0, [1, 2, 3])
    w.begin(1, [1, 2])
    w.remove(0, [2])
    assert w.extend(asked, [1, 2, 3]).blocks == {0: 1, 1: 2}
    w.remove(1)
    assert w.extend(asked, [1, 2, 3]).blocks == {0: 1}


def test_entries_end_a_horizon_after_landing_unless_recorded_again() -> None:
    w, now = writes()
    asked = Match({}, True, 0, asked_ms=0.0)
    w.begin(0, [1, 2])
    w.landed(0, [1, 2])
    w.begin(0, [2])  # routed again: in flight anew
    now[0] = 200.0  # past the horizon of the first landing
    w.begin(0, [9])
    w.landed(0, [9])  # (landings prune)
    assert len(w) == 2  # block 2 in flight again, block 9 just landed; block 1 ended
    assert w.extend(asked, [1, 2]).blocks == {}
    assert w.extend(asked, [2]).blocks == {0: 1}
