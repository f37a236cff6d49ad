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
        idx = MemoryIndex(block_size=16, capacity=12, eviction=mode, clock=clock, capacity_ratio=0.1)  # type: ignore[arg-type]
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
    idx = MemoryIndex(block_size=16, capacity=2, eviction="cost", capacity_ratio=0.1)
    for _ in range(3):
        idx.record_now(0, [1])
    for k in range(20):  # a long stream of fresh entries, each used twice
        idx.record_now(0, [1000 + k])
        idx.record_now(0, [1000 + k])
    assert idx.lookup_now([1]).blocks == {}


def held_prefix(idx: MemoryIndex, chain: list[int], replica: int = 0) -> int:
    return idx.lookup_now(chain).blocks.get(replica, 0)


def test_shared_prompt_outlives_a_scan_of_many_small_one_off_prompts() -> None:
    """Ageing counts capacity turnovers, not evictions: a stream of small one-offs (each evicting
    the previous one) must not age a reused prefix faster than LRU would age it."""

    def run(mode: str) -> int:
        idx = MemoryIndex(block_size=16, capacity=12, eviction=mode, capacity_ratio=0.1)  # type: ignore[arg-type]
        shared = [100, 101, 102, 103]
        for k in range(5):  # a system prompt used by five episodes, each with its own tail
            idx.record_now(0, [*shared, 500 + k])
        # then 24 one-off 2-block prompts (4 turnovers of the 12-entry bound); used 5 times, the
        # prompt outlives a one-off by 4 turnovers (per-eviction GDSF ageing lost it after ~10)
        for k in range(24):
            idx.record_now(0, [1000 + 10 * k, 1001 + 10 * k])
        return held_prefix(idx, shared)

    assert run("cost") == 4
    assert run("lru") == 0


def test_reuse_count_survives_eviction_as_a_ghost() -> None:
    """A prefix squeezed out by a long scan comes back with its history: after one more use it
    is protected at once, where a prefix used as often but never seen before is not."""
    clock = Clock()
    idx = MemoryIndex(block_size=16, capacity=8, eviction="cost", clock=clock, ghost_ttl_s=100, capacity_ratio=0.1)
    popular, fresh = [100, 101], [200, 201]
    for _ in range(4):
        idx.record_now(0, popular)
    for k in range(40):  # 5 turnovers of one-offs: even the popular prefix goes
        idx.record_now(0, [1000 + k])
    assert held_prefix(idx, popular) == 0 and idx._ghosts
    idx.record_now(0, popular)  # back, with 5 uses on record
    idx.record_now(0, fresh)  # new, 1 use
    for k in range(12):  # 1.5 turnovers
        idx.record_now(0, [2000 + k])
    assert held_prefix(idx, popular) == 2
    assert held_prefix(idx, fresh) == 0
    # Ghosts expire: after ghost_ttl_s the history is gone.
    for k in range(40):
        idx.record_now(0, [3000 + k])
    assert held_prefix(idx, popular) == 0 and idx._ghosts[100][0] == 5
    clock.t += 101
    idx.record_now(0, popular)
    assert idx._reuse[100] == 1


@pytest.mark.parametrize("copy_elsewhere", [False, True])
def test_a_copy_held_by_another_replica_is_worth_less(copy_elsewhere: bool) -> None:
    idx = MemoryIndex(block_size=16, capacity=4, eviction="cost", capacity_ratio=0.1)
    if copy_elsewhere:
        idx.record_now(1, [7])  # replica 1 holds block 7 too: dropping replica 0's copy recomputes nothing
    for _ in range(3):
        idx.record_now(0, [7])
        idx.record_now(0, [9])
    for k in range(7):  # one-offs
        idx.record_now(0, [1000 + k])
    assert held_prefix(idx, [9]) == 1
    assert held_prefix(idx, [7]) == (0 if copy_elsewhere else 1)
    assert idx.lookup_now([7]).blocks == ({1: 1} if copy_elsewhere else {0: 1})


def test_cost_eviction_never_strands_children_of_an_evicted_parent() -> None:
    """Mixed chains (shared prompts held on several replicas, private episode tails, confirms of
    output blocks): every replica's entries stay prefix-closed, so no entry is unreachable."""
    import random

    rng = random.Random(5)
    idx = MemoryIndex(block_size=16, capacity=40, eviction="cost")
    prompts = [[10_000 * p + j for j in range(rng.randint(3, 8))] for p in range(4)]
    parent: dict[int, int | None] = {}
    for step in range(600):
        base = prompts[rng.randrange(4)]
        chain = [*base, *(1_000_000 + 100 * step + j for j in range(rng.randint(0, 6)))]
        replica = rng.randrange(3)
        if rng.random() < 0.7:
            idx.record_now(replica, chain)
        else:  # the engine's report: the prompt plus two output blocks
            chain += [2_000_000 + 100 * step, 2_000_001 + 100 * step]
            idx.confirm_now(replica, chain)
        for a, b in zip([None, *chain], chain, strict=False):
            parent[b] = a
        for r in range(3):
            held = {h for h, holders in idx._holders.items() if r in holders}
            assert len(held) <= 40
            assert all(parent[h] is None or parent[h] in held for h in held), (step, r)


def test_reuse_never_keeps_an_entry_past_the_engines_lru_horizon() -> None:
    """Index as large as the KV (ratio 1): the engine's LRU drops an unused block after about one
    turnover, so the index does too, however often the block was used (else it would route
    turns to KV that is gone). Index = KV / 4: at most 4 turnovers."""

    def survives(ratio: float, turnovers: int) -> bool:
        idx = MemoryIndex(block_size=16, capacity=10, eviction="cost", capacity_ratio=ratio)
        for _ in range(50):
            idx.record_now(0, [1, 2])
        for k in range(10 * turnovers):
            idx.record_now(0, [1000 + k])
        return held_prefix(idx, [1, 2]) == 2

    assert not survives(1.0, 2)
    assert survives(0.25, 3) and not survives(0.25, 5)


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
