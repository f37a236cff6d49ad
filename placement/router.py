"""Routing of episodes to engine replicas.

``StickyLeastLoaded``: a new episode (or a whole GRPO group, so it shares one prompt
prefill) goes to the replica with the least in-flight tokens, ties broken by fewer open
episodes; later turns stay on that replica, which holds their KV. Load is counted in
tokens (prefill + decode budget), not requests. A group id stays pinned to its replica
while any of its episodes is open, so members added by a later StartEpisode join it.
"""

from __future__ import annotations


class StickyLeastLoaded:
    def __init__(self, replicas: int) -> None:
        self.inflight_tokens = [0] * replicas
        self.open_episodes = [0] * replicas
        self._groups: dict[str, tuple[int, int]] = {}  # group id -> (replica, open members)

    def place_group(self, group_id: str) -> int:
        """Replica for new episodes of ``group_id``."""
        if group_id in self._groups:
            return self._groups[group_id][0]
        return min(range(len(self.inflight_tokens)), key=lambda r: (self.inflight_tokens[r], self.open_episodes[r]))

    def attach(self, replica: int, group_id: str) -> None:
        self.open_episodes[replica] += 1
        self._groups[group_id] = (replica, self._groups.get(group_id, (replica, 0))[1] + 1)

    def detach(self, replica: int, group_id: str) -> None:
        self.open_episodes[replica] -= 1
        _, members = self._groups.pop(group_id, (replica, 1))
        if members > 1:
            self._groups[group_id] = (replica, members - 1)

    def begin(self, replica: int, tokens: int) -> None:
        self.inflight_tokens[replica] += tokens

    def end(self, replica: int, tokens: int) -> None:
        self.inflight_tokens[replica] -= tokens
