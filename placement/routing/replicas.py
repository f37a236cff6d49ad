"""The replicas one bridge routes over: their health and in-flight load.

Policies read this set and never own these vectors (SGLang router: health and load live on
the worker, not inside the policy). ``load`` is this bridge's own in-flight tokens per replica
(``begin``/``end`` around each engine call: uncached prefill + decode, and ``reserve`` from the routing decision
until that call begins: a decision is counted at once, so routing decisions made concurrently (a burst of
StartEpisode calls) see each other instead of all choosing the same replica); ``remote`` is the
other bridges' as a load board last reported them (``cache/loadboard.py`` publishes ``load``
and writes ``remote``; zeros without a board). An unhealthy replica gets no turns while a
healthy one exists.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence


class ReplicaSet:
    """Health and in-flight load per replica (see module docstring)."""

    RESERVE_TTL_S = 60.0  # a reservation whose engine call never began (the client never stepped) lapses

    def __init__(self, replicas: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.load = [0] * replicas
        self.remote = [0] * replicas
        self.healthy = [True] * replicas
        self.clock = clock
        self._tie = itertools.count()
        self._reserved: dict[str, tuple[int, int, float]] = {}  # key (episode id) -> replica, tokens, lapses at

    def __len__(self) -> int:
        return len(self.load)

    def mark(self, replica: int, healthy: bool) -> bool:
        """Record a replica's health (engine call failed / health check); True if that changed it."""
        changed = self.healthy[replica] != healthy
        self.healthy[replica] = healthy
        return changed

    def ok(self, replica: int | None) -> bool:
        """``replica`` exists and is healthy."""
        return replica is not None and replica < len(self.load) and self.healthy[replica]

    def up(self, among: Sequence[int] | None = None) -> list[int]:
        """The healthy replicas (of ``among``); all of them when none is healthy."""
        cands = list(range(len(self.load))) if among is None else list(among)
        return [r for r in cands if self.healthy[r]] or cands

    def view(self) -> list[int]:
        """Fleet-wide in-flight tokens per replica, as far as this bridge knows."""
        return [a + b for a, b in zip(self.load, self.remote, strict=False)]

    def tie(self) -> int:
        """A rotating offset: ties between equal replicas are broken differently each time."""
        return next(self._tie)

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        cands = self.up(among)
        off = self.tie()  # rotate ties so equal replicas share new work
        load = self.view()
        return min(cands, key=lambda r: (load[r], (r + off) % len(load)))

    def reserve(self, key: str, replica: int, tokens: int) -> None:
        """Count ``tokens`` of work routed to ``replica`` for ``key`` now, until ``begin(..., key)`` replaces them
        with the engine call's own load (or ``unreserve``, or ``RESERVE_TTL_S``). A new reservation for ``key``
        replaces the last one."""
        self.unreserve(key)
        now = self.clock()
        while self._reserved:  # oldest first (one TTL for all): stop at the first that still holds
            oldest = next(iter(self._reserved))
            if self._reserved[oldest][2] >= now:
                break
            self.unreserve(oldest)
        if tokens > 0:
            self.load[replica] += tokens
            self._reserved[key] = (replica, tokens, now + self.RESERVE_TTL_S)

    def unreserve(self, key: str) -> None:
        item = self._reserved.pop(key, None)
        if item is not None and item[0] < len(self.load):
            self.load[item[0]] = max(0, self.load[item[0]] - item[1])

    def begin(self, replica: int, tokens: int, key: str = "") -> None:
        if key:
            self.unreserve(key)
        self.load[replica] += tokens

    def end(self, replica: int, tokens: int) -> None:
        self.load[replica] = max(0, self.load[replica] - tokens)

    def resize(self, replicas: int) -> None:
        self.load = (self.load + [0] * replicas)[:replicas]
        self.remote = (self.remote + [0] * replicas)[:replicas]
        self.healthy = (self.healthy + [True] * replicas)[:replicas]
