"""Turn routing for one bridge: which engine replica serves each turn, and what the prefix index learns.

``Router`` owns the replica set (health, load; fed by the load board shared with other bridges
through Redis), the routing policy (one module each in this package), the prefix index
(``cache/``; none with a single replica, where there is nothing to decide), each episode's current
route and block-hash chain, and the open members of each GRPO group (a group's pin is released
with its last member). The bridge calls ``route`` before a turn, ``begin``/``end`` around it,
``report`` after it, and ``forget`` when the episode ends. It passes its episodes and turns as
they are: the router reads (and, on a move, sets ``replica`` of) only what ``EpisodeView`` and
``TurnView`` name, so placement never imports server.

No silent override: every configured policy runs as configured, except ``cache_aware`` without
an index, which runs sticky; that is logged once here and each such decision is counted with
reason ``fallback_sticky``. Pins live ``cache.affinity_ttl_s``. With ``routing.plan_file`` the
placement plan's per-replica KV capacity sizes the index.

A replica whose engine publishes KV events (``EngineInfo.kv_events``) has its entries kept by an
``EventIndexer`` (``cache/event_index.py``): stored blocks confirmed, evicted ones removed, a reset or
restart dropping them all; routing still writes provisional entries for the turns in flight (an
event confirms or evicts them; one nothing confirms expires after ``cache.provisional_ttl_s``).

Read-your-writes: before each decision the event batches that have reached the bridge are applied
(``EventIndexer.settled``, at most ``cache.event_settle_ms``), and the policy counts this bridge's
own provisional writes that Redis may not show yet (``cache/recent.py``), each recorded as its decision is
made, before the bridge awaits anything else. An episode's first turn is
not credited with what its own placement (``place``, at StartEpisode) recorded: the engine has
computed none of it; the other members of its GRPO group are.

Invariants: hashes are over the exact ids sent to the engine and salted per tenant, model and policy
version (``core.salt.CacheSalt``), so after a weight update no turn is routed on KV of older
weights; an episode's chain is only ever extended (histories are append-only), so a turn hashes its
new blocks only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from cache import CacheConfig, Fingerprinter, PrefixIndex, make_index
from cache.event_index import EventIndexer
from cache.kv_events import EventReader
from core.errors import InvalidArgument, PrimeRLError
from core.salt import CacheSalt, SaltBook
from core.types import FinishReason, Usage
from engines.base import Engine
from placement.routing.base import Decision, RouteRequest
from placement.routing.config import RoutingConfig
from placement.routing.factory import make_policy
from placement.routing.replicas import ReplicaSet

log = logging.getLogger("primerl.routing")


class EpisodeView(Protocol):
    """What routing reads of an episode (``server.episodes.Episode`` has it)."""

    id: str
    replica: int  # set by ``Router.route`` when the episode moves

    @property
    def token_ids(self) -> Sequence[int]: ...


class TurnView(Protocol):
    """What routing reads of a finished turn (``server.episodes.Turn`` has it)."""

    @property
    def finish_reason(self) -> FinishReason | None: ...

    @property
    def generation_start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def usage(self) -> Usage: ...


class Router:
    """Routing state of one bridge over its engine replicas (see module docstring)."""

    def __init__(self, engines: Sequence[Engine], cache: CacheConfig, routing: RoutingConfig, redis_url: str) -> None:
        self.engines = engines
        self.fingerprinter = Fingerprinter(cache.block_size, cache.hash_algo)
        self._settle_s = cache.event_settle_ms / 1e3
        self.replicas = ReplicaSet(len(engines))
        # One replica leaves nothing to route: no index to look up and write on every turn (the engine
        # still reports its own cached tokens, so hit metrics come from it).
        self.index: PrefixIndex | None = make_index(cache, redis_url) if cache.enabled and len(engines) > 1 else None
        if self.index is not None:
            kv = plan_kv_capacities(routing.plan_file, engines) if routing.plan_file else [0] * len(engines)
            for r, tokens in enumerate(kv):
                self.index.set_capacity(r, cache.capacity_for(tokens))
        # Replicas that publish KV events: their entries follow the events (exact), the rest are learned.
        self.events: dict[int, EventIndexer] = {}
        self._started = False
        for r in range(len(engines)):
            self.follow_events(r)
        self.policy = make_policy(routing, self.replicas, self.index, self.fingerprinter, cache.affinity_ttl_s)
        self.configured_policy = routing.policy
        if routing.policy == "cache_aware" and self.index is None:
            why = "one engine replica" if len(engines) <= 1 else "cache.enabled = false"
            (log.info if len(engines) <= 1 else log.warning)(
                "routing.policy cache_aware needs the prefix index, which is off (%s): turns are routed sticky per "
                "episode and GRPO group, counted as primerl_routing_decisions_total{reason='fallback_sticky'}",
                why,
            )
        self._board: Any = None  # bridges sharing a Redis index also share their in-flight load
        if self.index is not None and redis_url:
            from cache.loadboard import RedisLoadBoard
            from cache.redis_index import RedisIndex

            if isinstance(self.index, RedisIndex):
                self._board = RedisLoadBoard(self.index, self.replicas)
        self.routes: dict[str, tuple[Decision, str]] = {}  # episode id -> its current turn's route and salt
        self._chains: dict[str, tuple[str, list[int]]] = {}  # episode id -> (salt, block hashes so far)
        self._group_open: dict[str, int] = {}  # group key -> open members (to release the group's pin)
        self._placed: dict[str, tuple[int, int]] = {}  # episode placed, first turn not routed -> (replica, credit)

    def follow_events(self, replica: int) -> None:
        """Keep ``replica``'s index entries from its engine's KV events, if it publishes them (at start-up, and for
        a replica the fleet adds later: ``server.replicas.Replicas.add``)."""
        info = self.engines[replica].info
        if self.index is None or not info.kv_events or replica in self.events:
            return
        salts = getattr(self.engines[replica], "salts", None)  # the HTTP adapters' SaltBook: the salts each sent
        reader = EventReader(info.kv_events, info.kv_events_replay)
        indexer = EventIndexer(replica, self.index, self.fingerprinter, salts or SaltBook(), reader, info.replica)
        self.events[replica] = indexer
        if self._started:
            indexer.start()

    def start(self) -> None:
        """Start background work (the shared load board of a Redis index, the KV-event readers)."""
        self._started = True
        if self._board is not None:
            self._board.start()
        for indexer in self.events.values():
            indexer.start()

    async def close(self) -> None:
        for indexer in self.events.values():
            await indexer.stop()
        if self._board is not None:
            await self._board.stop()
        if self.index is not None:
            await self.index.close()

    def index_source(self, replica: int) -> str:
        """Where the index learns what ``replica`` holds: kv_events (exact), learned (routed turns and the
        engine's cached-token reports), or none (no index: one replica, or cache.enabled = false)."""
        if self.index is None:
            return "none"
        indexer = self.events.get(replica)
        return indexer.source if indexer is not None else "learned"

    def event_counts(self, replica: int) -> list[tuple[str, int]]:
        """(kind, count) of ``replica``'s KV events applied to the index (``EventIndexer.counts``)."""
        indexer = self.events.get(replica)
        return sorted(indexer.counts.items()) if indexer is not None else []

    def predictions(self) -> list[tuple[str, int]]:
        """(outcome, turns) of the index's credit against the engines' cached-token reports: exact | over | under."""
        return sorted(self.policy.stats.predictions.items())

    def decisions(self) -> list[tuple[str, str, int]]:
        """(policy, reason, turns so far) for every reason routing used: read at scrape time."""
        name = self.policy.name
        return [(name, reason, n) for reason, n in list(self.policy.stats.decisions.items())]

    def mark(self, replica: int, healthy: bool, reason: str = "") -> None:
        """Take a replica out of rotation (a call failed, a health check did) or bring it back."""
        if self.replicas.mark(replica, healthy):
            name = self.engines[replica].info.replica
            if healthy:
                log.info("engine replica %s is healthy again: back in rotation", name)
            else:
                log.warning("engine replica %s taken out of rotation: %s", name, reason or "unhealthy")

    async def place(self, request: RouteRequest) -> int:
        """The replica for a new episode (or GRPO group): its first turn is routed with its prompt."""
        await self._settle()
        decision = await self.policy.choose(request)
        self._reserve(request, decision)
        self._placed[request.episode_id] = (decision.replica, decision.matched_tokens)
        return decision.replica

    def _reserve(self, request: RouteRequest, decision: Decision) -> None:
        """The decided turn's work counts on its replica from now until its engine call begins (``begin``)."""
        load = request.est_tokens - decision.matched_tokens
        self.replicas.reserve(request.episode_id, decision.replica, load)

    def opened(self, group_key: str, members: int = 1) -> None:
        """``members`` more open episodes of a group (started here or loaded from another bridge)."""
        self._group_open[group_key] = self._group_open.get(group_key, 0) + members

    async def route(
        self, episode: EpisodeView, observation: Sequence[int], est_new: int, salt: CacheSalt | str, group: str
    ) -> None:
        """Choose the replica for the episode's next turn; move the episode there if it changed.

        A move (its replica failed, or was too loaded to keep it) sends the exact token history
        to the new replica, which recomputes what it does not have cached.
        """
        salt = str(salt)
        history = [*episode.token_ids, *observation]
        hashes = self._hashes(episode.id, history, salt) if self.index is not None else None
        request = RouteRequest(
            episode.id, group, history, salt, len(history) + est_new, hashes=hashes, current=episode.replica
        )
        self.replicas.unreserve(episode.id)  # its placement's reservation: this decision replaces it, not weighs it
        await self._settle()
        decision = await self.policy.choose(request)
        placed = self._placed.pop(episode.id, None)
        if placed is not None and placed[0] == decision.replica and decision.matched_tokens > placed[1]:
            # Its first turn, where it was placed: what its own placement recorded there is not cached yet.
            decision = dataclasses.replace(decision, matched_tokens=placed[1])
        self._reserve(request, decision)
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

    async def _settle(self) -> None:
        """Read-your-writes for the exact index: the KV events already delivered are applied before routing reads
        it (``EventIndexer.settled``; a lagging indexer delays the decision by ``cache.event_settle_ms`` at most)."""
        behind = [ix for ix in self.events.values() if ix.behind] if self._settle_s > 0 else []
        if behind:
            await asyncio.gather(*(ix.settled(self._settle_s) for ix in behind))

    def current(self, episode: EpisodeView) -> tuple[Decision, str] | None:
        """The route of the episode's current turn, if it was routed to the replica the episode is on."""
        route = self.routes.get(episode.id)
        return route if route is not None and route[0].replica == episode.replica else None

    def begin(self, replica: int, load: int, episode_id: str = "") -> None:
        """A turn's engine call begins: ``load`` in-flight tokens replace the episode's routing reservation."""
        self.replicas.begin(replica, load, episode_id)

    def end(self, replica: int, load: int) -> None:
        self.replicas.end(replica, load)

    async def report(self, episode: EpisodeView, turn: TurnView, route: tuple[Decision, str]) -> int:
        """Tell the index what the engine now holds after a turn routed by ``route`` (or, if the turn failed
        early, what it does not); returns the prefix tokens routing predicted were cached."""
        decision, salt = route
        if self.index is None:
            return 0
        ok = turn.finish_reason != FinishReason.ABORT or turn.end > turn.generation_start
        held = self._hashes(episode.id, episode.token_ids, salt) if ok else None
        indexer = self.events.get(decision.replica)
        if indexer is not None:
            indexer.turn_served()
        learned = indexer is None or indexer.silent
        await self.policy.observe(decision, turn.usage.cached_tokens, ok=ok, held_hashes=held, learned=learned)
        return decision.matched_tokens

    async def forget(self, episode_id: str, group_key: str) -> None:
        """Drop an ended episode's routing state (and its group's, with its last member)."""
        self.routes.pop(episode_id, None)
        self._chains.pop(episode_id, None)
        self._placed.pop(episode_id, None)
        self.replicas.unreserve(episode_id)
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


def plan_kv_capacities(path: str, engines: Sequence[Engine]) -> list[int]:
    """KV capacity in tokens of each engine replica, from a placement plan's replica list (engine order)."""
    from placement.mig.endpoints import load_endpoints

    model = engines[0].info.model
    mine = [e for e in load_endpoints(path) if e.model == model]
    if len(mine) != len(engines):
        raise InvalidArgument(
            f"routing.plan_file {path!r} lists {len(mine)} replicas of model {model!r}, but the bridge has "
            f"{len(engines)} engine replicas: plan and engine.urls must describe the same replicas"
        )
    return [e.kv_capacity_tokens for e in mine]
