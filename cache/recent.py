"""Routing's own index writes that a lookup answered earlier cannot show yet (read-your-writes for one bridge).

A Redis index write is a background task (``RedisIndex.record``): a turn never waits for it. So when turns that
share a prefix are routed at once (a GRPO group's members, sessions over one system prompt, an agent's next turn
right after its last), each one's lookup may be answered before the others' provisional entries reach Redis, and
routing credits nothing that the engine then serves from cache (``primerl_routing_predictions{outcome="under"}``).

``RecentWrites`` remembers the blocks this bridge recorded for each replica, from the moment routing decided until
``horizon_ms`` after the write landed, and ``extend`` adds them to a lookup's answer when the lookup was asked
before they landed (one asked later reads them from Redis, which then knows better: an eviction since, or another
bridge's drop). An eviction or drop this bridge learns of (KV events, a failed turn, a forgotten replica) removes
them at once. In-process only: another bridge sees them when Redis does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from cache.index import Match

IN_FLIGHT = math.inf  # recorded, the write not landed yet


class RecentWrites:
    """Blocks recorded by this bridge, per replica, until ``horizon_ms`` after their write landed."""

    def __init__(self, horizon_ms: float, clock_ms: Callable[[], float]) -> None:
        self.horizon_ms = horizon_ms
        self.clock_ms = clock_ms
        self._held: dict[int, dict[int, float]] = {}  # block hash -> replica -> when its write landed
        self._landed: deque[tuple[float, int, int]] = deque()  # (landed at, hash, replica), oldest first

    def __len__(self) -> int:
        return sum(len(r) for r in self._held.values())

    def begin(self, replica: int, hashes: Iterable[int]) -> None:
        """Routing recorded ``hashes`` for ``replica``; the write is on its way."""
        for h in hashes:
            self._held.setdefault(h, {})[replica] = IN_FLIGHT

    def landed(self, replica: int, hashes: Iterable[int]) -> None:
        """The write of ``hashes`` ended (written, or given up: then the horizon still ends the entry)."""
        now = self.clock_ms()
        for h in hashes:
            held = self._held.get(h)
            if held is not None and held.get(replica) == IN_FLIGHT:
                held[replica] = now
                self._landed.append((now, h, replica))
        self._prune(now)

    def remove(self, replica: int, hashes: Iterable[int] | None = None) -> None:
        """``replica`` no longer holds ``hashes`` (None: anything)."""
        if hashes is None:
            for h in [h for h, held in self._held.items() if replica in held]:
                self._drop(h, replica)
            return
        for h in hashes:
            self._drop(h, replica)

    def extend(self, match: Match, hashes: Sequence[int]) -> Match:
        """``match`` (asked at ``match.asked_ms``) with each replica's chain continued through the blocks this
        bridge recorded for it that had not landed when it was asked."""
        if not match.ok or not hashes or not self._held:
            return match
        blocks = dict(match.blocks)
        for r in {*blocks, *self._held.get(hashes[0], {})}:
            n = blocks.get(r, 0)
            while n < len(hashes) and self._held.get(hashes[n], {}).get(r, -math.inf) >= match.asked_ms:
                n += 1
            blocks[r] = n
        blocks = {r: n for r, n in blocks.items() if n}
        return match if blocks == match.blocks else replace(match, blocks=blocks)

    def _drop(self, h: int, replica: int) -> None:
        held = self._held.get(h)
        if held is not None and held.pop(replica, None) is not None and not held:
            del self._held[h]

    def _prune(self, now: float) -> None:
        while self._landed and self._landed[0][0] + self.horizon_ms < now:
            at, h, r = self._landed.popleft()
            held = self._held.get(h)
            if held is not None and held.get(r) == at:  # not recorded again since
                self._drop(h, r)


__all__ = ["IN_FLIGHT", "RecentWrites"]
