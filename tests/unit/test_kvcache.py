"""The embedded engine's KV caches: in-place growth, crop, batch packing and the byte-bounded LRU store."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from core.types import EngineCounters  # noqa: E402
from engines.embedded.kvcache import (  # noqa: E402
    SLACK,
    KVStore,
    Parked,
    cache_nbytes,
    common_prefix,
    fork,
    kv_tensors,
    new_cache,
    pack_left,
    unpack_left,
)

LAYERS, HEADS, DIM = 3, 2, 4


def kv(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, HEADS, tokens, DIM, generator=g), torch.randn(1, HEADS, tokens, DIM, generator=g))
        for _ in range(LAYERS)
    ]


def append(cache, chunk: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for li, (k, v) in enumerate(chunk):
        cache.update(k, v, li)


def test_appends_in_place_equal_concatenation() -> None:
    cache = new_cache(data=kv(5, 0))
    chunks = [kv(1, s) for s in range(1, 40)] + [kv(300, 99)]  # decode steps, then a long observation
    for c in chunks:
        append(cache, c)
    for li, (k, v) in enumerate(kv_tensors(cache)):
        want_k = torch.cat([kv(5, 0)[li][0], *(c[li][0] for c in chunks)], dim=-2)
        want_v = torch.cat([kv(5, 0)[li][1], *(c[li][1] for c in chunks)], dim=-2)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # The spare room is counted: the budget covers what is held, not what is used.
    used = sum(int(k.nbytes + v.nbytes) for k, v in kv_tensors(cache))
    assert used < cache_nbytes(cache) <= used + 2 * LAYERS * HEADS * DIM * 4 * (SLACK + 344 // 4 + 1)


def test_crop_then_append_overwrites_the_cropped_tail() -> None:
    cache = new_cache(data=kv(10, 0))
    append(cache, kv(1, 1))
    cache.crop(-3)  # drop the last 3 positions (a rejected draft, or a shorter common prefix)
    new = kv(2, 2)
    append(cache, new)
    for li, (k, _) in enumerate(kv_tensors(cache)):
        assert k.shape[-2] == 10
        assert torch.equal(k[..., :8, :], kv(10, 0)[li][0][..., :8, :])
        assert torch.equal(k[..., 8:, :], new[li][0])


def test_fork_is_independent() -> None:
    cache = new_cache(data=kv(6, 0))
    copy = fork(cache)
    append(copy, kv(1, 1))
    assert kv_tensors(cache)[0][0].shape[-2] == 6 and kv_tensors(copy)[0][0].shape[-2] == 7
    assert torch.equal(kv_tensors(copy)[0][0][..., :6, :], kv_tensors(cache)[0][0])


def test_pack_left_pads_and_unpack_returns_each_row() -> None:
    lengths = [3, 7, 5]
    rows = [new_cache(data=kv(n, i)) for i, n in enumerate(lengths)]
    batch, mask = pack_left(rows, lengths)
    assert mask.tolist() == [[0, 0, 0, 0, 1, 1, 1], [1] * 7, [0, 0, 1, 1, 1, 1, 1]]
    keys = kv_tensors(batch)[0][0]
    assert keys.shape == (3, HEADS, 7, DIM)
    assert torch.equal(keys[0, :, 4:], kv(3, 0)[0][0][0]) and not keys[0, :, :4].any()
    # One shared decode step: every row gains a position; unpacking gives each row its own, unpadded cache.
    step = [(torch.randn(3, HEADS, 1, DIM), torch.randn(3, HEADS, 1, DIM)) for _ in range(LAYERS)]
    append(batch, step)
    out = unpack_left(batch, [n + 1 for n in lengths])
    for row, (cache, n) in enumerate(zip(out, lengths, strict=True)):
        for li, (k, v) in enumerate(kv_tensors(cache)):
            assert k.shape == (1, HEADS, n + 1, DIM)
            assert torch.equal(k[0, :, :n], kv(n, row)[li][0][0]) and torch.equal(v[0, :, n], step[li][1][row, :, 0])
    append(out[0], kv(1, 5))  # each row grows on its own again
    assert kv_tensors(out[0])[0][0].shape[-2] == lengths[0] + 2 and kv_tensors(out[1])[0][0].shape[-2] == 8


def parked(nbytes: int) -> Parked:
    return Parked((1, 2), new_cache(data=kv(1, 0)), None, "m@0", 0, nbytes)


def test_store_evicts_least_recently_used_under_its_byte_budget() -> None:
    counters = EngineCounters(extra={})
    store = KVStore(250, counters)
    store.put(("ep", "a"), parked(100))
    store.put(("grp", "g"), parked(100))
    assert store.peek(("ep", "a")) is not None  # a is now the most recently used
    store.put(("ep", "b"), parked(100))  # 300 > 250: the least recently used (g) goes
    assert ("grp", "g") not in store and ("ep", "a") in store and ("ep", "b") in store
    assert store.nbytes == 200 and counters.extra["kv_bytes"] == 200 and counters.extra["kv_evictions"] == 1
    assert store.take(("ep", "a")) is not None and store.take(("ep", "a")) is None
    store.clear(keep=lambda key: key[0] == "grp")
    assert store.nbytes == 0 and counters.extra["kv_bytes"] == 0


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], (1, 2, 3)) == 2
    assert common_prefix((), [1]) == 0
