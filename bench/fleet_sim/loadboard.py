"""The simulator's in-process load board: several bridges' policies in one process see each other's load.

The bridge's real board is ``cache.loadboard.RedisLoadBoard`` (vectors shared through Redis every period);
this is its in-process equivalent for the fleet simulator, a bench fixture that does not ship.
"""

from __future__ import annotations

from cache.loadboard import LoadTarget


class MemoryLoadBoard:
    """In-process: several policies (bridges in one process, the simulator) see each other's load."""

    def __init__(self, targets: list[LoadTarget]) -> None:
        self.targets = targets

    def sync_once(self) -> None:
        n = max(len(t.load) for t in self.targets)
        total = [0] * n
        for t in self.targets:
            for i, x in enumerate(t.load):
                total[i] += x
        for t in self.targets:
            t.remote = [total[i] - (t.load[i] if i < len(t.load) else 0) for i in range(n)]
