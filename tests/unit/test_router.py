"""Sticky least-loaded routing: groups pinned, unhealthy replicas skipped, episodes relocated with their group."""

from __future__ import annotations

from placement.router import StickyLeastLoaded


def test_new_groups_go_to_the_least_loaded_healthy_replica() -> None:
    r = StickyLeastLoaded(3)
    r.begin(0, 100)
    r.attach(0, "g0")
    assert r.place_group("g1") == 1
    r.attach(1, "g1")
    assert r.place_group("g1") == 1  # pinned while open
    assert r.mark(2, healthy=False) and not r.mark(2, healthy=False)
    assert r.place_group("g2") != 2
    r.mark(1, healthy=False)
    assert r.place_group("g1") == 0  # its pinned replica is down: new members go elsewhere


def test_relocate_moves_a_group_member_by_member_to_one_healthy_replica() -> None:
    r = StickyLeastLoaded(3)
    for _ in range(3):
        r.attach(0, "g")
    r.begin(1, 50)  # replica 2 is the least loaded
    assert r.relocate(0, "g") == 0  # healthy: stays
    r.mark(0, healthy=False)
    moved = [r.relocate(0, "g") for _ in range(3)]
    assert moved == [2, 2, 2]
    assert r.open_episodes == [0, 0, 3]
    assert r.place_group("g") == 2
    r.detach(2, "g")
    assert r.place_group("g") == 2  # the pin survives a member leaving


def test_no_healthy_replica_keeps_the_episode_where_it_is() -> None:
    r = StickyLeastLoaded(2)
    r.attach(0, "g")
    r.mark(0, healthy=False)
    r.mark(1, healthy=False)
    assert r.relocate(0, "g") == 0
    assert r.place_group("h") in (0, 1)
    r.mark(1, healthy=True)
    assert r.relocate(0, "g") == 1 and r.open_episodes == [0, 1]
