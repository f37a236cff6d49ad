"""The exact index: one replica's entries in the prefix index kept equal to what its KV events say it holds.

An ``EventIndexer`` reads one replica's KV events (``cache/kv_events.py``) and writes the index:

- ``BlockStored``: the blocks are hashed *our* way (``Fingerprinter``: chained from the parent's hash, or
  from the salt's root for a chain's first block) and confirmed for the replica. The engine's block
  size must be a multiple of the index's: one engine block is then ``k`` of our blocks. A first block's
  salt is the ``cache_salt`` the engine reports (vLLM), mapped back through the adapter's ``SaltBook``;
  an engine that reports none (SGLang) gets the salt last sent with that LoRA adapter.
- ``BlockRemoved``: the blocks' entries are evicted (``PrefixIndex.evict``, confirmed or not).
- ``AllBlocksCleared``, a sequence gap replay could not fill (``Resync``), or a restarted publisher
  (``Restarted``): every entry of the replica is dropped (``forget_replica``); later events relearn it.

A map from the engine's block hashes to ours (per replica, as large as the replica's cache) turns
removals into our keys. It counts copies: vLLM does not de-duplicate its cache (two requests that each fill
a block with the same content, e.g. greedy runs of one prompt where the prompt ends and the output begins,
cache two blocks under one hash) and publishes a ``BlockStored`` per block cached and a ``BlockRemoved`` per
block evicted, so a hash stays in the index until its last copy goes (evicting it at the first removal made
the index deny a block the replica still held). A block whose parent or salt is unknown (stored before the
bridge subscribed and not replayed, or sent by another bridge with a salt this one never used) is not
indexed; it is counted as ``unmapped``, and its removal later is ignored. Writes (``PrefixIndex.sync``) are
awaited one event at a time, so a store and a removal of one block reach Redis in the engine's order; they
are not the routing path's fire-and-forget writes, which give up after ``write_timeout_ms`` and skip Redis
for a backoff (a lost event write would make the index lie for good). A write that still fails (Redis down)
counts ``write_failures``: the replica's entries are dropped as soon as Redis answers again, and relearned.

Several bridges on one Redis each follow every replica's events and write the same entries (confirming
twice, or evicting twice, changes nothing); a block stored under a salt only one bridge sent is written by
that bridge. Known limit: a bridge that applies a replica's reset late may drop entries another bridge
already relearned after it; they come back with the replica's next events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence

from cache.fingerprint import Fingerprinter
from cache.index import PrefixIndex, SyncOp
from cache.kv_events import Cleared, EngineHash, EventReader, Message, Removed, Restarted, Resync, Stored
from core.salt import SaltBook

log = logging.getLogger("primerl.cache.events")


class EventIndexer:
    """Keeps replica ``replica``'s index entries equal to its engine's KV events (see module docstring)."""

    def __init__(
        self,
        replica: int,
        index: PrefixIndex,
        fingerprinter: Fingerprinter,
        salts: SaltBook,
        reader: EventReader | None = None,
        name: str = "",
    ) -> None:
        self.replica = replica
        self.index = index
        self.fp = fingerprinter
        self.salts = salts
        self.reader = reader
        self.name = name or f"replica {replica}"
        self.counts: Counter[str] = Counter()  # stored, removed, cleared, resyncs, ..., batches, write_failures
        self.blocks: dict[EngineHash, tuple[int, ...]] = {}  # engine block hash -> our block hashes
        self.copies: Counter[EngineHash] = Counter()  # engine block hash -> blocks the replica holds with it
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        self._lost = False  # an event write failed: the replica's entries are unknown until dropped
        self._busy = False  # a batch read from the socket is being applied
        self._progress = asyncio.Event()  # set after each batch is applied (``settled`` waits on it)

    SILENT_TURNS = 3  # turns served with no event batch ever received before the replica counts as silent

    @property
    def source(self) -> str:
        """What this replica's index entries come from (a metric label): kv_events, or learned while its
        publisher has been silent through ``SILENT_TURNS`` turns (a wrong endpoint, events turned off)."""
        return "learned" if self.silent else "kv_events"

    @property
    def silent(self) -> bool:
        return self.counts["batches"] == 0 and self.counts["turns"] >= self.SILENT_TURNS

    def turn_served(self) -> None:
        """A turn ended on this replica: a replica that stores blocks publishes events, so silence is noticed."""
        self.counts["turns"] += 1
        if self.silent and "silent" not in self._warned:
            self._warned.add("silent")
            log.warning(
                "kv events of %s: nothing received from %s after %d turns; the index learns this replica from "
                "routed turns until its events arrive (check the engine's --kv-events-config and the URL fragment)",
                self.name,
                self.reader.endpoint if self.reader is not None else "its publisher",
                self.counts["turns"],
            )

    def start(self) -> None:
        if self.reader is None or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.reader is not None:
            self.reader.close()

    async def _run(self) -> None:
        assert self.reader is not None
        while True:
            try:
                async for msg in self.reader.messages():
                    self._busy = True  # (no await between the read and here: ``settled`` never misses it)
                    try:
                        await self.apply(msg)
                    finally:
                        self._busy = False
                        self._progress.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad batch stop the index from following the replica
                log.exception("kv events of %s: reading failed; its entries are dropped and relearned", self.name)
                await self._drop_all("errors")
                self.reader.close()
                await asyncio.sleep(1.0)

    @property
    def behind(self) -> bool:
        """A batch is being applied, or has reached the socket and waits to be."""
        return self._busy or (self._task is not None and self.reader is not None and self.reader.pending())

    async def settled(self, within_s: float) -> bool:
        """Wait until every batch that has reached this bridge's socket is applied, at most ``within_s``: a routing
        decision made then reads the blocks the replica stored for the turns that already ended (vLLM publishes a
        step's events before it returns the step's tokens), not the index as it stood a few writes ago. False
        when the time ran out (counted as ``settle_timeouts``); True at once when nothing is pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self.behind:
            left = deadline - loop.time()
            if left <= 0:
                self.counts["settle_timeouts"] += 1
                return False
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        return True

    async def apply(self, msg: Message) -> None:
        """One message of the replica's event stream, applied to the index."""
        if self._lost:
            await self._drop_all("recoveries")
            if self._lost:
                return  # Redis still fails: nothing of this message can be written either
        if isinstance(msg, Resync):
            log.warning(
                "kv events of %s: batches %d..%d lost and not replayable; dropping its index entries (relearned "
                "from its next events)",
                self.name,
                msg.expected,
                msg.got - 1,
            )
            await self._drop_all("resyncs")
            return
        if isinstance(msg, Restarted):
            log.warning(
                "kv events of %s: the publisher restarted (batch %d after %d); dropping its entries",
                self.name,
                msg.got,
                msg.last,
            )
            await self._drop_all("restarts")
            return
        self.counts["batches"] += 1
        for event in msg.events:
            if isinstance(event, Stored):
                await self._stored(event)
            elif isinstance(event, Removed):
                await self._removed(event.block_hashes)
            elif isinstance(event, Cleared):
                await self._drop_all("cleared")
            if self._lost:
                return

    async def _drop_all(self, why: str) -> None:
        self.blocks.clear()
        self.copies.clear()
        if await self._sync("forget"):
            self.counts[why] += 1
            self._lost = False

    async def _sync(self, op: SyncOp, hashes: Sequence[int] = ()) -> bool:
        if await self.index.sync(self.replica, op, hashes):
            return True
        self.counts["write_failures"] += 1
        if not self._lost:
            self._lost = True
            log.warning(
                "kv events of %s: the index write failed; its entries are dropped once Redis answers", self.name
            )
        return False

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    async def _stored(self, e: Stored) -> None:
        b = self.fp.block_size
        if e.block_size % b:
            self._warn_once(
                "size",
                "kv events of %s: engine block size %d is not a multiple of cache.block_size %d; its events cannot "
                "be indexed (set cache.block_size to the engine's block size)",
                self.name,
                e.block_size,
                b,
            )
            self.counts["unmapped"] += len(e.block_hashes)
            return
        k = e.block_size // b
        if e.parent is None:
            salt = self.salts.resolve(e.cache_salt, e.lora_name)
            if salt is None:
                self.counts["unmapped"] += len(e.block_hashes)
                return
            ours = self.fp.hashes(e.token_ids, salt)
        else:
            parent = self.blocks.get(e.parent)
            if parent is None:
                self.counts["unmapped"] += len(e.block_hashes)
                return
            ours = self.fp.chain(parent[-1], e.token_ids)
        for i, h in enumerate(e.block_hashes):
            self.blocks[h] = tuple(ours[i * k : (i + 1) * k])
            self.copies[h] += 1
        self.counts["stored"] += len(e.block_hashes)
        await self._sync("confirm", ours)

    async def _removed(self, hashes: Sequence[EngineHash]) -> None:
        gone: list[int] = []
        for h in hashes:
            if h not in self.blocks:
                continue  # never mapped (stored before we subscribed, or unmapped): nothing of ours to evict
            self.counts["removed"] += 1
            self.copies[h] -= 1
            if self.copies[h] > 0:
                continue  # another copy of the block is still cached
            del self.copies[h]
            gone.extend(self.blocks.pop(h))
        if gone:
            await self._sync("evict", gone)
