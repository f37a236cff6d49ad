"""``consistent_hash``: a hash ring (virtual nodes) over the group id, else the episode id.

``key="prefix"`` hashes the first block's hash instead (SGLang's ``prefix_hash``: one system
prompt, one replica). ``load_bound`` > 0 gives bounded-load hashing: replicas above
``load_bound`` x mean load are skipped, and the least-loaded replica takes the turn when all
are. An unhealthy owner passes the turn to the next healthy one clockwise. Needs no index.
"""

from __future__ import annotations

import bisect

import xxhash

from cache.fingerprint import Fingerprinter
from placement.routing.base import Decision, PolicyBase, RouteRequest
from placement.routing.replicas import ReplicaSet


class ConsistentHash(PolicyBase):
    name = "consistent_hash"

    def __init__(
        self,
        replicas: ReplicaSet | int,
        vnodes: int = 64,
        load_bound: float = 0.0,
        key: str = "session",
        block_size: int = 16,
    ) -> None:
        super().__init__(replicas)
        self.vnodes = vnodes
        self.load_bound = load_bound
        self.key = key
        self.fp = Fingerprinter(block_size=block_size)
        self._built_for = -1
        self._points: list[int] = []
        self._owners: list[int] = []

    def _ring(self) -> tuple[list[int], list[int]]:
        """The ring over the current replicas (rebuilt when the replica set was resized)."""
        n = len(self.replicas)
        if n != self._built_for:
            ring = sorted(
                (xxhash.xxh3_64_intdigest(f"replica-{r}#{v}".encode()), r) for r in range(n) for v in range(self.vnodes)
            )
            self._points = [p for p, _ in ring]
            self._owners = [r for _, r in ring]
            self._built_for = n
        return self._points, self._owners

    def _point(self, req: RouteRequest) -> int:
        if self.key == "prefix":
            hashes = req.hashes if req.hashes is not None else self.fp.hashes(req.token_ids, req.salt)
            return xxhash.xxh3_64_intdigest(hashes[0].to_bytes(8, "little") if hashes else req.episode_id.encode())
        return xxhash.xxh3_64_intdigest((req.group_id or req.episode_id).encode())

    async def choose(self, req: RouteRequest) -> Decision:
        points, owners = self._ring()
        healthy = self.replicas.healthy
        i = bisect.bisect(points, self._point(req)) % len(points)
        if self.load_bound <= 0:
            for k in range(len(points)):  # the first healthy owner clockwise
                r = owners[(i + k) % len(points)]
                if healthy[r]:
                    return self._decide(r, "ring")
            return self._decide(owners[i], "ring")
        load = self.replicas.view()
        limit = self.load_bound * (sum(load) + req.est_tokens) / len(load)
        for k in range(len(points)):
            r = owners[(i + k) % len(points)]
            if load[r] + req.est_tokens <= limit and healthy[r]:
                return self._decide(r, "ring")
        return self._decide(self.replicas.least_loaded(), "load")
