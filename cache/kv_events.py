"""Engine KV events: what a replica's prefix cache stores and evicts, read from its ZMQ publisher.

vLLM (``--kv-events-config``) and SGLang (``--kv-events-config``) publish the same three events
over a ZMQ PUB socket, one multipart message per engine step: ``[topic, seq (8 B big-endian),
payload]``, the payload a msgpack ``[ts, [event, ...], dp_rank?]``:

- ``BlockStored``: ``block_hashes`` (the engine's own hashes, bytes or int), ``parent_block_hash``
  (None for a chain's first block), ``token_ids`` (every stored block's tokens, concatenated),
  ``block_size``, ``lora_id``, ``medium``; vLLM adds ``lora_name`` and ``extra_keys`` (per block:
  the LoRA name, multimodal keys and the request's ``cache_salt``, which vLLM mixes into block 0).
- ``BlockRemoved``: ``block_hashes`` evicted.
- ``AllBlocksCleared``: the cache was reset (``POST /reset_prefix_cache``).

vLLM 0.32 encodes each event as a map with a ``type`` field; SGLang (and vLLM before 0.11) as an
array ``[type, field, ...]`` in the order above. ``decode_batch`` reads both, and ignores fields it
does not know (newer engines add them). The publisher numbers batches from 0 when it starts and
keeps the last ``buffer_steps`` for replay on its ROUTER socket: send ``[b"", seq]`` (8 B
big-endian), receive ``[b"", topic, seq, payload]`` per buffered batch from ``seq`` on, then an
end marker with seq -1.

``EventReader`` is the subscriber: it yields ``Batch`` objects in order and tells the caller when
the stream cannot be trusted: a sequence gap it could not fill by replay (``Resync``), or the
sequence starting again (the engine restarted: ``Restarted``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("primerl.cache.events")

EngineHash = bytes | int
END_SEQ = -1
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class EventFormatError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # the salt the engine mixed into block 0 (vLLM's extra_keys), if it says
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]


@dataclass(frozen=True, slots=True)
class Resync:
    """Batches were lost and replay could not return them: the replica's index entries are unknown."""

    expected: int
    got: int


@dataclass(frozen=True, slots=True)
class Restarted:
    """The sequence started again: the engine restarted with an empty cache."""

    last: int
    got: int


Message = Batch | Resync | Restarted


def _hash(v: Any) -> EngineHash:
    if isinstance(v, bytes | int) and not isinstance(v, bool):
        return v
    raise EventFormatError(f"a block hash must be bytes or an integer, got {type(v).__name__}")


def _salt_of(extra_keys: Any, lora_name: str | None) -> str | None:
    """vLLM's ``extra_keys[0]``: (lora name if any, mm keys..., cache_salt?, embed digests...); the salt
    is the one plain string after the LoRA name (mm keys are tuples, digests bytes)."""
    if not isinstance(extra_keys, list | tuple) or not extra_keys or not extra_keys[0]:
        return None
    keys = list(extra_keys[0])
    if lora_name is not None and keys and keys[0] == lora_name:
        keys = keys[1:]
    strings = [k for k in keys if isinstance(k, str)]
    return strings[0] if strings else None


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        raise EventFormatError(f"an event must be a map or a tagged array, got {type(raw).__name__}")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in _FIELDS:
        return None  # an event kind this bridge does not know: newer engines may add some
    if fields.get("group_idx") not in (None, 0):
        return None  # another KV cache group (hybrid models): not the attention prefix cache
    hashes = tuple(_hash(h) for h in fields.get("block_hashes") or ())
    medium = fields.get("medium")
    if kind == "BlockRemoved":
        return Removed(hashes, medium)
    parent = fields.get("parent_block_hash")
    lora = fields.get("lora_name")
    size = fields.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise EventFormatError(f"BlockStored without a valid block_size: {size!r}")
    tokens = tuple(int(t) for t in fields.get("token_ids") or ())
    if len(tokens) != size * len(hashes):
        raise EventFormatError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    return Stored(
        hashes,
        None if parent is None else _hash(parent),
        tokens,
        size,
        lora,
        _salt_of(fields.get("extra_keys"), lora),
        medium,
    )


def decode_batch(seq: int, payload: bytes) -> Batch:
    """One published batch (either encoding); raises ``EventFormatError`` for anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"batch {seq}: not msgpack ({exc})") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list | tuple):
        raise EventFormatError(f"batch {seq}: expected [ts, events, ...], got {type(raw).__name__}")
    events = tuple(e for e in (_event(x) for x in raw[1]) if e is not None)
    return Batch(seq, float(raw[0]), events)


def encode_batch(events: Sequence[Event], ts: float = 0.0, arrays: bool = False) -> bytes:
    """A payload as vLLM 0.32 (maps) or SGLang (``arrays``) publishes it: the stand-ins' and tests' side."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, Cleared):
            out.append(["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"})
            continue
        if isinstance(e, Removed):
            fields: dict[str, Any] = {"block_hashes": list(e.block_hashes), "medium": e.medium}
            kind = "BlockRemoved"
        else:
            fields = {
                "block_hashes": list(e.block_hashes),
                "parent_block_hash": e.parent,
                "token_ids": list(e.token_ids),
                "block_size": e.block_size,
                "lora_id": None,
                "medium": e.medium,
            }
            kind = "BlockStored"
            if not arrays:
                keys = [k for k in (e.lora_name, e.cache_salt) if k is not None]
                fields |= {"lora_name": e.lora_name, "extra_keys": [keys or None] + [None] * (len(e.block_hashes) - 1)}
        out.append([kind, *fields.values()] if arrays else {"type": kind, **fields})
    return msgspec.msgpack.encode([ts, out])


class EventReader:
    """Subscribes to one replica's publisher; ``messages()`` yields batches in sequence order.

    A gap (a batch number skipped: the PUB socket drops when a subscriber lags, or the bridge joined
    late) is filled from the replay endpoint when there is one (``replay_timeout_s``); else, or when
    replay cannot return every missing batch, a ``Resync`` is yielded and reading goes on from the
    new batch. The very first batch after connecting counts as a gap from 0 (the replica may hold
    blocks stored before the bridge subscribed). A sequence number lower than the last one read means
    the publisher restarted: ``Restarted``.
    """

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "", replay_timeout_s: float = 2.0):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.last: int | None = None
        self._filling = False  # replaying a gap (``pending``)
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None

    def connect(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def pending(self) -> bool:
        """Whether a batch has reached the socket and waits to be read (``zmq.EVENTS``; pyzmq's asyncio socket
        re-arms its own reader when asked this way, so the read in ``messages`` still wakes), or one that was read
        waits for the replay of a gap before it."""
        if self._filling:  # a gap's batches are being replayed: the batch that showed it waits behind them
            return True
        return self._sub is not None and bool(int(self._sub.get(zmq.EVENTS)) & zmq.POLLIN)

    async def messages(self) -> AsyncIterator[Message]:
        if self._sub is None:
            self.connect()
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events from %s: a message of %d frames ignored", self.endpoint, len(frames))
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self.last is not None and seq <= self.last:
                if seq < self.last:
                    last, self.last = self.last, None
                    yield Restarted(last, seq)
                    for msg in await self._fill(0, seq):
                        yield msg
                    yield self._decode(seq, frames[2])
                continue  # a duplicate (replayed and then received live)
            expected = 0 if self.last is None else self.last + 1
            if seq > expected:
                for msg in await self._fill(expected, seq):
                    yield msg
            yield self._decode(seq, frames[2])

    def _decode(self, seq: int, payload: bytes) -> Batch:
        self.last = seq
        try:
            return decode_batch(seq, payload)
        except EventFormatError as exc:
            log.warning("kv events from %s: %s", self.endpoint, exc)
            return Batch(seq, 0.0, ())

    async def _fill(self, start: int, stop: int) -> list[Message]:
        """Batches ``start .. stop - 1`` from the replay endpoint, or a ``Resync`` if they cannot all be had."""
        self._filling = True
        try:
            got = await self.replay(start) if self.replay_endpoint else {}
        finally:
            self._filling = False
        missing = [s for s in range(start, stop) if s not in got]
        if missing:
            return [Resync(start, stop)]
        return [self._decode(s, got[s]) for s in range(start, stop)]

    async def replay(self, start: int) -> dict[int, bytes]:
        """Every buffered batch from ``start`` on, as the publisher's replay socket returns them."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: dict[int, bytes] = {}
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        continue
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        break
                    out[seq] = frames[3]
        except TimeoutError:
            log.warning("kv events: replay from %s timed out after %.1f s", self.replay_endpoint, self.replay_timeout_s)
        finally:
            sock.close(linger=0)
        return out
