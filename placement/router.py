"""Routing of episodes to engine replicas.

``StickyLeastLoaded``: a new episode (or a whole GRPO group, so it shares one prompt
prefill) goes to the replica with the least in-flight tokens, ties broken by fewer open
episodes; later turns stay on that replica, which holds their KV. Load is counted in
tokens (prefill + decode budget), not requests. A group id stays pinned to its replica
while any of its episodes is open, so members added by a later StartEpisode join it.

Replica health: a replica marked unhealthy (an engine call failed, or a health check did)
gets no new episodes, and ``relocate`` moves an episode off it to the least-loaded healthy
replica (the bridge then resubmits the episode's exact token history there). A health
check that passes again re-admits it. With no healthy replica left, placement still
answers (the least-loaded one) so the caller gets the engine's own clear error.
"""

from __future__ import annotations


class StickyLeastLoaded:
    def __init__(self, replicas: int) -> None:
        self.inflight_tokens = [0] * replicas
        self.open_episodes = [0] * replicas
        self._groups: dict[str, tuple[int, int]] = {}  # group id -> (replica, open members)
        self.healthy = [True] * replicas

    def _least_loaded(self, exclude: int | None = None) -> int:
        candidates = [r for r in range(len(self.healthy)) if self.healthy[r] and r != exclude]
        if not candidates:
            candidates = [r for r in range(len(self.healthy)) if r != exclude] or [0]
        return min(candidates, key=lambda r: (self.inflight_tokens[r], self.open_episodes[r]))

    def place_group(self, group_id: str) -> int:
        """Replica for new episodes of ``group_id``."""
        if group_id in self._groups and self.healthy[self._groups[group_id][0]]:
            return self._groups[group_id][0]
        return self._least_loaded()

    def mark(self, replica: int, healthy: bool) -> bool:
        """Record a replica's health; True if that changed it."""
        changed = self.healthy[replica] != healthy
        self.healthy[replica] = healthy
        return changed

    def relocate(self, replica: int, group_id: str) -> int:
        """Move one open episode of ``group_id`` off an unhealthy ``replica``; returns its new replica.

        Returns ``replica`` itself when it is healthy or no other replica is healthy.
        """
        if self.healthy[replica]:
            return replica
        target = self._least_loaded(exclude=replica)
        if not self.healthy[target]:
            return replica
        self.detach(replica, group_id)
        pinned = self._groups.get(group_id)
        if pinned is not None and pinned[0] != target and self.healthy[pinned[0]]:
            target = pinned[0]  # the rest of the group already moved: follow it
        self.attach(target, group_id)
        return target

    def attach(self, replica: int, group_id: str) -> None:
        self.open_episodes[replica] += 1
        self._groups[group_id] = (replica, self._groups.get(group_id, (replica, 0))[1] + 1)

    def detach(self, replica: int, group_id: str) -> None:
        self.open_episodes[replica] -= 1
        pinned, members = self._groups.pop(group_id, (replica, 1))
        if members > 1:
            self._groups[group_id] = (pinned, members - 1)

    def begin(self, replica: int, tokens: int) -> None:
        self.inflight_tokens[replica] += tokens

    def end(self, replica: int, tokens: int) -> None:
        self.inflight_tokens[replica] -= tokens
