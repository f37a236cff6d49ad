"""Which of one bridge's engine replicas are in rotation, and the replica API the fleet changes them through.

A replica leaves rotation when a call, a health check or a weight update fails (``mark``; a passing health check
brings it back), or when the fleet withdraws it (``withdraw``: drained, removed, or down elsewhere in the fleet);
a withdrawn replica stays out, whatever its health checks say, until ``restore``, and a removed one gets no
weight update either. ``add`` puts a new replica in the list that ``Turns``, ``Weights`` and the router share.

Nothing outside the bridge writes this state: the fleet (``server.fleet.member``) calls ``add``, ``withdraw`` and
``restore`` on ``Bridge.replicas``.
"""

from __future__ import annotations

from engines.base import Engine
from placement.routing import Router
from server.turns import Turns
from server.weights import Weights


class Replicas:
    """A bridge's replica list and what keeps a replica out of rotation (see module docstring)."""

    def __init__(self, engines: list[Engine], router: Router, turns: Turns, weights: Weights) -> None:
        self.engines = engines  # the bridge's list, shared with Turns, Weights and the router
        self._router = router
        self._turns = turns
        self._weights = weights
        self.withdrawn: dict[int, str] = {}  # replica -> why it is out of rotation for good (drained, removed)

    def mark(self, replica: int, healthy: bool, reason: str = "") -> None:
        """Take a replica out of rotation (a call failed, a health check did) or bring it back."""
        if healthy and replica in self.withdrawn:  # drained, removed or failed elsewhere in the fleet: stays out
            healthy, reason = False, self.withdrawn[replica]
        self._router.mark(replica, healthy, reason)

    def add(self, engine: Engine) -> int:
        """A new replica in rotation; returns its index."""
        self.engines.append(engine)
        self._router.replicas.resize(len(self.engines))
        self._router.follow_events(len(self.engines) - 1)
        return len(self.engines) - 1

    async def withdraw(self, replica: int, state: str, abort: bool) -> None:
        """No new turns on ``replica`` (``state`` says why: drained, removed, down); with ``abort`` it gets no
        weight update and its running turns end now (ABORT, partial tokens kept)."""
        self.withdrawn[replica] = state
        self._router.mark(replica, False, f"{state} through the control plane")
        if abort:
            self._weights.removed.add(replica)
            engine = self.engines[replica]
            for request_id, running in list(self._turns.live.items()):
                if running is engine:
                    await engine.abort(request_id)

    def restore(self, replica: int, confirm: bool = False) -> None:
        """A withdrawn replica back in rotation; with ``confirm`` (it had failed) only once its next health check
        passes at the current version."""
        self.withdrawn.pop(replica, None)
        self._weights.removed.discard(replica)
        if not confirm:
            self._router.mark(replica, True, "")
