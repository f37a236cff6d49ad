"""Turn routing for the bridge: which engine replica serves each turn, and what the prefix index learns.

``Router`` owns the routing policy (``placement.policies``), the prefix index (``cache/``; none with a
single replica, where there is nothing to decide), the load board shared with other bridges (Redis),
each episode's current route and block-hash chain, and the open members of each GRPO group (a group's
pin is released with its last member). The bridge calls ``route`` before a turn, ``begin``/``end``
around it, ``report`` after it, and ``forget`` when the episode ends.

Invariants: hashes are over the exact ids sent to the engine and salted per tenant, model and policy
version, so after a weight update no turn is routed on KV of older weights; an episode's chain is only
ever extended (histories are append-only), so a turn hashes its new blocks only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from cache import CacheConfig, Fingerprinter, make_index
from engines.base import Engine
from engines.types import FinishReason
from placement.policies import Decision, RouteRequest, RoutingConfig, make_policy
from server.episodes import Episode, Turn
from server.errors import PrimeRLError

log = logging.getLogger("primerl.server")


class Router:
    """Routing state of one bridge over its engine replicas (see module docstring)."""

    def __init__(self, engines: Sequence[Engine], cache: CacheConfig, routing: RoutingConfig, redis_url: str) -> None:
        self.engines = engines
        self.fingerprinter = Fingerprinter(cache.block_size, cache.hash_algo)
        # One replica leaves nothing to route: no index to look up and write on every turn (the engine
        # still reports its own cached tokens, so hit metrics come from it).
        self.index = make_index(cache, redis_url) if cache.enabled and len(engines) > 1 else None
        if self.index is not None:
            for r in range(len(engines)):
                self.index.set_capacity(r, cache.capacity_for(0))
        policy = routing if self.index is not None else routing.model_copy(update={"policy": "sticky"})
        self.policy = make_policy(policy, len(engines), self.index, self.fingerprinter)
        self._board: Any = None  # bridges sharing a Redis index also share their in-flight load
        if self.index is not None and redis_url:
            from cache.loadboard import RedisLoadBoard
            from cache.redis_index import RedisIndex

            if isinstance(self.index, RedisIndex):
                self._board = RedisLoadBoard(self.index, self.policy)
        self.routes: dict[str, tuple[Decision, str]] = {}  # episode id -> its current turn's route and salt
        self._chains: dict[str, tuple[str, list[int]]] = {}  # episode id -> (salt, block hashes so far)
        self._group_open: dict[str, int] = {}  # group key -> open members (to release the group's pin)

    def start(self) -> None:
        """Start background work (the shared load board of a Redis index)."""
        if self._board is not None:
            self._board.start()

    async def close(self) -> None:
        if self._board is not None:
            await self._board.stop()
        if self.index is not None:
            await self.index.close()

    def mark(self, replica: int, healthy: bool, reason: str = "") -> None:
        """Take a replica out of rotation (a call failed, a health check did) or bring it back."""
        if self.policy.mark(replica, healthy):
            name = self.engines[replica].info.replica
            if healthy:
                log.info("engine replica %s is healthy again: back in rotation", name)
            else:
                log.warning("engine replica %s taken out of rotation: %s", name, reason or "unhealthy")

    async def place(self, request: RouteRequest) -> int:
        """The replica for a new episode (or GRPO group): its first turn is routed with its prompt."""
        return (await self.policy.choose(request)).replica

    def opened(self, group_key: str, members: int = 1) -> None:
        """``members`` more open episodes of a group (started here or loaded from another bridge)."""
        self._group_open[group_key] = self._group_open.get(group_key, 0) + members

    async def route(self, episode: Episode, observation: Sequence[int], est_new: int, salt: str, group: str) -> None:
        """Choose the replica for the episode's next turn; move the episode there if it changed.

        A move (its replica failed, or was too loaded to keep it) sends the exact token history
        to the new replica, which recomputes what it does not have cached.
        """
        history = [*episode.token_ids, *observation]
        hashes = self._hashes(episode.id, history, salt) if self.index is not None else None
        decision = await self.policy.choose(
            RouteRequest(episode.id, group, history, salt, len(history) + est_new, hashes=hashes)
        )
        self.routes[episode.id] = (decision, salt)
        old = episode.replica
        if decision.replica != old:
            episode.replica = decision.replica
            log.warning(
                "episode %s moved from replica %s to %s (%s; %d tokens resubmitted)",
                episode.id,
                self.engines[old].info.replica,
                self.engines[decision.replica].info.replica,
                decision.reason,
                len(history),
            )
            with contextlib.suppress(PrimeRLError, OSError, TimeoutError):  # the old replica may be down
                async with asyncio.timeout(2.0):
                    await self.engines[old].release(episode.id)

    def current(self, episode: Episode) -> tuple[Decision, str] | None:
        """The route of the episode's current turn, if it was routed to the replica the episode is on."""
        route = self.routes.get(episode.id)
        return route if route is not None and route[0].replica == episode.replica else None

    def begin(self, replica: int, load: int) -> None:
        self.policy.on_begin(replica, load)

    def end(self, replica: int, load: int) -> None:
        self.policy.on_end(replica, load)

    async def report(self, episode: Episode, turn: Turn, route: tuple[Decision, str]) -> int:
        """Tell the index what the engine now holds after a turn routed by ``route`` (or, if the turn failed
        early, what it does not); returns the prefix tokens routing predicted were cached."""
        decision, salt = route
        if self.index is None:
            return 0
        ok = turn.finish_reason != FinishReason.ABORT or turn.end > turn.generation_start
        held = self._hashes(episode.id, episode.token_ids, salt) if ok else None
        await self.policy.on_engine_report(decision, turn.usage.cached_tokens, ok=ok, held_hashes=held)
        return decision.matched_tokens

    async def forget(self, episode_id: str, group_key: str) -> None:
        """Drop an ended episode's routing state (and its group's, with its last member)."""
        self.routes.pop(episode_id, None)
        self._chains.pop(episode_id, None)
        await self.policy.release(episode_id=episode_id)
        left = self._group_open.get(group_key, 1) - 1
        if left > 0:
            self._group_open[group_key] = left
        else:
            self._group_open.pop(group_key, None)
            await self.policy.release(group_id=group_key)

    def _hashes(self, episode_id: str, token_ids: Sequence[int], salt: str) -> list[int]:
        """Block hashes of an episode's history: its cached chain, extended by the new blocks."""
        cached = self._chains.get(episode_id)
        prev = cached[1] if cached is not None and cached[0] == salt else []
        hashes = self.fingerprinter.extend(prev, token_ids, salt)
        self._chains[episode_id] = (salt, hashes)
        return hashes
