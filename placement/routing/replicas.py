"""The replicas one bridge routes over: their health and in-flight load.

Policies read this set and never own these vectors (SGLang router: health and load live on
the worker, not inside the policy). ``load`` is this bridge's own in-flight tokens per replica
(``begin``/``end`` around each engine call: uncached prefill + decode); ``remote`` is the
other bridges' as a load board last reported them (``cache/loadboard.py`` publishes ``load``
and writes ``remote``; zeros without a board). An unhealthy replica gets no turns while a
healthy one exists.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class ReplicaSet:
    """Health and in-flight load per replica (see module docstring)."""

    def __init__(self, replicas: int) -> None:
        self.load = [0] * replicas
        self.remote = [0] * replicas
        self.healthy = [True] * replicas
        self._tie = itertools.count()

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

    def begin(self, replica: int, tokens: int) -> None:
        self.load[replica] += tokens

    def end(self, replica: int, tokens: int) -> None:
        self.load[replica] = max(0, self.load[replica] - tokens)

    def resize(self, replicas: int) -> None:
        self.load = (self.load + [0] * replicas)[:replicas]
        self.remote = (self.remote + [0] * replicas)[:replicas]
        self.healthy = (self.healthy + [True] * replicas)[:replicas]
