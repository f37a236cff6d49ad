"""Fleet routing of episode calls: a Step or EndEpisode sent to a bridge that does not hold the episode goes
to the bridge that owns it (issue 21: a trainer may call any bridge; never NOT_FOUND for a live episode).

``FleetOwnerInterceptor`` (innermost, after auth; ``server.fleet.ownership``'s base, shared with bridge workers)
looks at calls whose request names an ``episode_id``:

* held here (``Bridge.store``): served here, no registry read (the common case costs one dict lookup);
* owned by another bridge (``placement.registry``: episode -> owner address, written at StartEpisode):
  forwarded there with ``server.fleet.forward`` (status, metadata and stream passed back unchanged), marked with
  ``primerl-fleet-forwarded-by`` so a call is never forwarded twice;
* owner unreachable (its process died): with ``persistence.enabled`` this bridge takes the episode over from
  Redis (the persistence lease guards against two bridges stepping it; a lease the dead bridge held for a Step
  it was running is broken, compare-and-delete on its token) and records itself as the owner;
  without persistence the call fails UNAVAILABLE saying the episode died with its bridge;
* registry unreachable: served here (fail open, counted by the membership).
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from server.bridge import Bridge
from server.errors import PrimeRLError
from server.fleet.member import FleetMember
from server.fleet.ownership import Owner, OwnerInterceptorBase

FORWARDED_BY = "primerl-fleet-forwarded-by"


class FleetOwnerInterceptor(OwnerInterceptorBase):
    """Sends episode calls to the bridge that owns the episode (see module docstring)."""

    hop_key = FORWARDED_BY
    owner_kind = "bridge"

    def __init__(self, bridge: Bridge, persistence: bool) -> None:
        super().__init__(persistence)
        self.bridge = bridge
        self.member: FleetMember | None = None  # the bridge's membership, once it joined (``join``)

    def join(self, member: FleetMember) -> None:
        """The bridge joined the fleet (once its port is bound): from now on calls are routed to owners."""
        self.member = member

    def wraps(self, method: str) -> bool:
        return method.endswith(("/Step", "/EndEpisode"))

    async def owner(self, request: Any, context: grpc.aio.ServicerContext) -> Owner | None:
        fleet, episode = self.member, request.episode_id
        if fleet is None or self.bridge.store.peek(episode) is not None:
            return None
        try:
            owner, holder = await fleet.store.owner(episode)
        except PrimeRLError as exc:
            fleet.failed_open(exc)
            return None
        return Owner(owner, owner, holder) if owner and owner != fleet.address else None

    def hop(self) -> tuple[tuple[str, str], ...]:
        return ((FORWARDED_BY, self.member.address if self.member is not None else ""),)

    async def take_over(self, owner: Owner, episode: str) -> None:
        journal = self.bridge.journal
        if owner.token and journal is not None:  # a Step the dead bridge was running holds the lease: it never ends
            with contextlib.suppress(PrimeRLError):  # Redis down: the lease expires by itself
                await journal.break_lease(episode, owner.token)
        if self.member is not None:
            await self.member.own([episode])
