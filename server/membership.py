"""What a bridge asks of its fleet membership: the fleet's policy version, a check before each turn, episode
ownership and fleet-wide weight updates.

``server.fleet.member.FleetMember`` is the implementation. It imports the bridge (and changes its replicas only
through ``Bridge.replicas``, ``server.replicas``); the bridge knows it only as this Protocol, never by import.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from placement.registry import BridgeRecord


class FleetMembership(Protocol):
    @property
    def version(self) -> int:
        """The fleet's policy version of the bridge's model (the last known)."""
        ...

    async def start(self) -> None:
        """Register, adopt the fleet's version and start the background reads."""

    async def before_turn(self) -> None:
        """Adopt a newer fleet version before a turn opens."""

    async def own(self, episode_ids: list[str]) -> None:
        """Record the bridge as the owner of episodes it started or took over."""

    async def disown(self, episode_id: str) -> None:
        """Drop the record of an ended episode."""

    async def update_weights(self, path: str, version: int, mode: str, apply: Callable[[int], Awaitable[int]]) -> int:
        """Run a weight update fleet-wide; ``apply(version)`` reloads this bridge's replicas."""
        ...

    async def bridges(self) -> list[BridgeRecord]:
        """The live bridges serving the model, as the registry lists them."""
        ...

    async def close(self) -> None:
        """Leave the fleet."""
