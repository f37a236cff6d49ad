"""The routing vocabulary and the ``Policy`` protocol every policy module implements.

A policy has one required method, ``choose(RouteRequest) -> Decision``, and a ``name`` (a
metric label); ``PolicyBase`` gives the defaults of the rest: ``observe`` (the engine's
cached-token count once the turn ended: confirms or drops what routing wrote to the index; with
``learned=False`` the replica's KV events keep its entries and a turn that ran confirms nothing),
``release`` (an episode or GRPO group ended), ``replica_reset`` (a replica lost its KV).
Health and load are read from the ``ReplicaSet`` the policy is given, never kept by it.

``Decision.reason`` is a small enum (a metric label): rr | load | sticky | group | ring |
cache | shed | fail_open | fallback_sticky. Every decision is counted by reason in
``stats.decisions`` (exported as ``primerl_routing_decisions_total``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from placement.routing.replicas import ReplicaSet


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One turn to place. ``hashes`` (block hashes of ``token_ids`` under ``salt``) may be passed precomputed."""

    episode_id: str
    group_id: str = ""
    token_ids: Sequence[int] = ()
    salt: str = ""  # str(core.salt.CacheSalt)
    est_tokens: int = 0  # in-flight tokens the turn adds (prompt + max new tokens)
    hashes: Sequence[int] | None = None
    prompt_tokens: int | None = None  # defaults to len(token_ids)
    first_turn: bool = False  # no pin can exist yet: skip the pin look-ups
    # The replica the episode is on now (its persisted record, the same on every bridge); None: unknown.
    current: int | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.token_ids) if self.prompt_tokens is None else self.prompt_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """Where the turn goes and why (``reason`` is a small enum: a metric label)."""

    replica: int
    matched_tokens: int = 0  # prefix tokens the index credits to ``replica``
    reason: str = "load"
    hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0  # the turn's prompt (history) length


@dataclass(slots=True)
class RoutingStats:
    decisions: dict[str, int] = field(default_factory=dict)  # reason -> turns routed for it
    predicted_tokens: int = 0  # index-credited prefix tokens of reported turns
    reported_cached_tokens: int = 0  # what engines reported for them
    stale_routes: int = 0  # turns whose credited prefix the engine did not have
    # Per reported turn, the credited prefix against what the engine reported cached, at block granularity (the
    # credit capped as engines cap a hit: a prompt's last token is always computed): exact | over | under.
    predictions: dict[str, int] = field(default_factory=dict)


class Policy(Protocol):
    name: str
    replicas: ReplicaSet
    stats: RoutingStats

    async def choose(self, req: RouteRequest) -> Decision: ...

    async def observe(
        self,
        decision: Decision,
        cached_tokens: int,
        ok: bool = True,
        held_hashes: Sequence[int] | None = None,
        learned: bool = True,
    ) -> None: ...

    async def release(self, episode_id: str = "", group_id: str = "") -> None: ...

    async def replica_reset(self, replica: int) -> None: ...


class PolicyBase:
    """Decision counting and the no-op defaults shared by every policy."""

    name = "base"

    def __init__(self, replicas: ReplicaSet | int) -> None:
        self.replicas = replicas if isinstance(replicas, ReplicaSet) else ReplicaSet(replicas)
        self.stats = RoutingStats()

    def _decide(
        self, replica: int, reason: str, matched: int = 0, hashes: Sequence[int] = (), prompt_tokens: int = 0
    ) -> Decision:
        self.stats.decisions[reason] = self.stats.decisions.get(reason, 0) + 1
        return Decision(replica, matched, reason, tuple(hashes), prompt_tokens)

    async def observe(
        self,
        decision: Decision,
        cached_tokens: int,
        ok: bool = True,
        held_hashes: Sequence[int] | None = None,
        learned: bool = True,
    ) -> None:
        return None

    async def release(self, episode_id: str = "", group_id: str = "") -> None:
        return None

    async def replica_reset(self, replica: int) -> None:
        return None
