"""``round_robin``: the cache-blind baseline; the next healthy replica in turn."""

from __future__ import annotations

import itertools

from placement.routing.base import Decision, PolicyBase, RouteRequest
from placement.routing.replicas import ReplicaSet


class RoundRobin(PolicyBase):
    name = "round_robin"

    def __init__(self, replicas: ReplicaSet | int) -> None:
        super().__init__(replicas)
        self._next = itertools.count()

    async def choose(self, req: RouteRequest) -> Decision:
        healthy = self.replicas.healthy
        n = len(healthy)
        for _ in range(n):
            r = next(self._next) % n
            if healthy[r]:
                return self._decide(r, "rr")
        return self._decide(next(self._next) % n, "rr")
