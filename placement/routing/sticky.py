"""``sticky``: an episode (and every member of a GRPO group) stays where its first turn went.

First turns go to the least-loaded replica; a pin to an unhealthy replica is ignored (the
episode moves). Pins are local to one bridge. ``StickyFallback`` is what ``cache_aware`` runs
when there is no prefix index: the same decisions, counted with reason ``fallback_sticky`` so
the substitution is visible on the routing-decisions series, never silent.
"""

from __future__ import annotations

from collections.abc import Sequence

from placement.routing.base import Decision, PolicyBase, RouteRequest
from placement.routing.replicas import ReplicaSet


class StickyEpisode(PolicyBase):
    name = "sticky"

    def __init__(self, replicas: ReplicaSet | int, group_colocate: bool = True) -> None:
        super().__init__(replicas)
        self.group_colocate = group_colocate
        self._episodes: dict[str, int] = {}
        self._groups: dict[str, int] = {}

    async def choose(self, req: RouteRequest) -> Decision:
        ok = self.replicas.ok
        r = self._episodes.get(req.episode_id)
        if r is not None and ok(r):
            return self._decide(r, "sticky")
        g = self._groups.get(req.group_id) if req.group_id and self.group_colocate else None
        if g is not None and ok(g):
            r, reason = g, "group"
        else:
            r, reason = self.replicas.least_loaded(), "load"
            if req.group_id and self.group_colocate:
                self._groups[req.group_id] = r
        self._episodes[req.episode_id] = r
        return self._decide(r, reason)

    async def release(self, episode_id: str = "", group_id: str = "") -> None:
        self._episodes.pop(episode_id, None)
        self._groups.pop(group_id, None)


class StickyFallback(StickyEpisode):
    """``sticky`` standing in for a policy that cannot apply (``cache_aware`` without an index)."""

    def __init__(
        self, replicas: ReplicaSet | int, group_colocate: bool = True, instead_of: str = "cache_aware"
    ) -> None:
        super().__init__(replicas, group_colocate)
        self.name = instead_of  # the configured policy stays the metric label; the reason says what ran

    def _decide(
        self, replica: int, reason: str, matched: int = 0, hashes: Sequence[int] = (), prompt_tokens: int = 0
    ) -> Decision:
        return super()._decide(replica, "fallback_sticky", matched, hashes, prompt_tokens)
