"""``least_loaded``: the replica with the fewest in-flight tokens fleet-wide (ties rotate)."""

from __future__ import annotations

from placement.routing.base import Decision, PolicyBase, RouteRequest


class LeastLoaded(PolicyBase):
    name = "least_loaded"

    async def choose(self, req: RouteRequest) -> Decision:
        return self._decide(self.replicas.least_loaded(), "load")
