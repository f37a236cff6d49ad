"""In-memory prefix index: longest-prefix lookups, provisional entries, bounds and eviction."""

from __future__ import annotations

import pytest

from cache import CacheConfig, MemoryIndex, make_index


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_lookup_returns_leading_blocks_per_replica_and_stops_at_first_miss() -> None:
    idx = MemoryIndex(block_size=16, capacity=100)
    idx.confirm_now(0, [1, 2, 3, 4])
    idx.confirm_now(1, [1, 2])
    m = idx.lookup_now([1, 2, 3, 9, 10])
    assert m.ok and m.blocks == {0: 3, 1: 2}
    assert m.looked_up == 4  # block 9 missed everywhere: the walk stopped there
    assert m.tokens(0, 16) == 48
    assert idx.lookup_now([7, 1, 2]).blocks == {}  # a chain only counts from its first block


def test_provisional_entries_expire_unless_confirmed_and_can_be_dropped() -> None:
    clock = Clock()
    idx = MemoryIndex(block_size=16, capacity=100, provisional_ttl_s=5, clock=clock)
    idx.record_now(0, [1, 2, 3])
    idx.record_now(1, [1, 2, 3])
    assert idx.lookup_now([1, 2, 3]).blocks == {0: 3, 1: 3}
    idx.confirm_now(1, [1, 2])
    clock.t += 6
    assert idx.lookup_now([1, 2, 3]).blocks == {1: 2}
    idx.record_now(2, [1, 2])
    idx.drop_now(2, [1, 2])
    idx.drop_now(1, [1, 2])  # confirmed entries are not dropped
    assert idx.lookup_now([1, 2]).blocks == {1: 2}


@pytest.mark.parametrize("mode", ["cost", "lru"])
def test_bound_per_replica_evicts_tails_before_parents(mode: str) -> None:
    idx = MemoryIndex(block_size=16, capacity=4, eviction=mode)  # type: ignore[arg-type]
    idx.confirm_now(0, [1, 2, 3])
    idx.confirm_now(0, [7, 8, 9])
    assert idx.entries() == 4
    assert idx.stats.evictions == 2
    # Whatever went, what is left is a prefix of a chain (a parent outlives its children).
    for chain in ([1, 2, 3], [7, 8, 9]):
        held = [h in idx._holders for h in chain]
        assert held == sorted(held, reverse=True)


def test_cost_eviction_keeps_a_hot_shared_prefix_that_lru_loses() -> None:
    clock = Clock()

    def run(mode: str) -> int:
        idx = MemoryIndex(block_size=16, capacity=12, eviction=mode, clock=clock)  # type: ignore[arg-type]
        shared = [100, 101, 102, 103]
        for _ in range(5):  # a system prompt used by five requests
            idx.record_now(0, shared)
            clock.t += 1
        for k in range(3):  # then a scan of one-off long prompts
            idx.record_now(0, [1000 * (k + 1) + j for j in range(4)])
            clock.t += 1
        return idx.lookup_now(shared).blocks.get(0, 0)

    assert run("cost") == 4
    assert run("lru") < 4


def test_ageing_lets_new_entries_displace_stale_popular_ones() -> None:
    idx = MemoryIndex(block_size=16, capacity=2, eviction="cost")
    for _ in range(3):
        idx.record_now(0, [1])
    for k in range(20):  # a long stream of fresh entries, each used twice
        idx.record_now(0, [1000 + k])
        idx.record_now(0, [1000 + k])
    assert idx.lookup_now([1]).blocks == {}


def test_forget_replica_and_pins() -> None:
    clock = Clock()
    idx = MemoryIndex(block_size=16, clock=clock)
    idx.confirm_now(0, [1, 2])
    idx.confirm_now(1, [1, 2])
    idx.forget_replica_now(0)
    assert idx.lookup_now([1, 2]).blocks == {1: 2}
    assert idx.pin_now("e:x", 3, 10) == 3
    assert idx.pin_now("e:x", 5, 10) == 3  # first writer wins
    clock.t += 11
    assert idx.pinned_now("e:x") is None


def test_factory_picks_the_backend() -> None:
    assert isinstance(make_index(CacheConfig()), MemoryIndex)
    with pytest.raises(ValueError, match=r"redis\.url"):
        make_index(CacheConfig(backend="redis"))
