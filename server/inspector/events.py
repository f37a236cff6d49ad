"""The inspector's events, fanned out to live pages: one bounded queue per subscriber, never blocking the bridge.

Invariants:
- ``publish`` is synchronous and O(subscribers): the bridge calls it on its Step path and never waits on a page;
- a subscriber's queue holds at most ``size`` events: a page that reads slower than the bridge writes loses the
  oldest, and its next read starts with one ``lagged`` event telling it to refetch (drop and coalesce);
- a subscriber sees the events of its tenant only (``tenant=None``: every tenant's, for admin tenants), and the
  events of no tenant (weight updates, pauses) always;
- event ids are ``<boot>-<seq>``: a page that reconnects with ``Last-Event-ID`` gets what it missed from the
  recent ring, or (another process, or too old) a ``reset`` telling it to refetch everything.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    kind: str  # episode_started, step_started, step_ended, episode_ended, weights_updated, paused, resumed
    tenant: str | None  # None: every subscriber sees it
    data: dict[str, Any]


class Subscriber:
    """One live page's queue (see module docstring)."""

    def __init__(self, tenant: str | None, size: int) -> None:
        self.tenant = tenant
        self.size = size
        self.dropped = 0
        self.closed = False
        self._queue: deque[Event] = deque()
        self._wake = asyncio.Event()

    def sees(self, event: Event) -> bool:
        return event.tenant is None or self.tenant is None or event.tenant == self.tenant

    def offer(self, event: Event) -> None:
        if len(self._queue) >= self.size:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(event)
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def wait(self, timeout: float) -> list[Event]:
        """The events queued now, waiting up to ``timeout`` for one (empty: timed out, or closed)."""
        if not self._queue and not self.closed:
            self._wake.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                return []
        batch = list(self._queue)
        self._queue.clear()
        return batch

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n


class EventHub:
    """Subscribers, the recent ring (for reconnects and the JSON form of the stream) and this process's boot id."""

    def __init__(self, queue_size: int, history: int = 512) -> None:
        self.boot = secrets.token_hex(4)
        self.queue_size = queue_size
        self._seq = itertools.count(1)
        self._recent: deque[Event] = deque(maxlen=history)
        self._subscribers: set[Subscriber] = set()

    def __len__(self) -> int:
        return len(self._subscribers)

    def event_id(self, event: Event) -> str:
        return f"{self.boot}-{event.seq}"

    def publish(self, kind: str, tenant: str | None, data: dict[str, Any]) -> None:
        event = Event(next(self._seq), kind, tenant, data)
        self._recent.append(event)
        for sub in self._subscribers:
            if sub.sees(event):
                sub.offer(event)

    def subscribe(self, tenant: str | None) -> Subscriber:
        sub = Subscriber(tenant, self.queue_size)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)

    def since(self, last_id: str, tenant: str | None) -> list[Event] | None:
        """The events after ``last_id`` this tenant may see; None when they are not all here (refetch)."""
        boot, _, seq = last_id.partition("-")
        if boot != self.boot or not seq.isdigit():
            return None
        after = int(seq)
        if self._recent and self._recent[0].seq > after + 1:
            return None  # some fell off the ring
        probe = Subscriber(tenant, 1)
        return [e for e in self._recent if e.seq > after and probe.sees(e)]

    def close(self) -> None:
        """End every live stream (shutdown: the front door then stops without waiting on them)."""
        for sub in list(self._subscribers):
            sub.close()


def sse(event_id: str | None, kind: str, data: dict[str, Any]) -> str:
    """One server-sent event (without ``id``: the client's Last-Event-ID stays the last event's that had one)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
