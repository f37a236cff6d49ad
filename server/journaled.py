"""The episode store as the bridge sees it: episodes in this process, journaled to Redis when persistence is on.

``JournaledStore`` wraps the in-process ``EpisodeStore`` and the optional ``EpisodeJournal``
(``server.persistence``). Without a journal every method is a no-op returning at once, so a bridge
without persistence pays nothing for it.

Invariants:
- a Step or an EndEpisode holds the episode's lease (across bridges) from before it reads the
  record until after it wrote it back; a second one anywhere gets FAILED_PRECONDITION;
- the local copy is brought up to the newest persisted revision before it is used;
- with ``persistence.required`` a failed Redis call fails the RPC; otherwise it is logged, counted as
  a fail-open, and the episode goes on in memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from observability.metrics import BridgeMetrics
from server.episodes import Episode, EpisodeStore
from server.errors import EpisodeBusy
from server.persistence import EpisodeJournal, PersistenceUnavailable

log = logging.getLogger("primerl.server")


class JournaledStore:
    """Open episodes, their persisted records and their cross-bridge leases (see module docstring)."""

    def __init__(
        self,
        store: EpisodeStore,
        journal: EpisodeJournal | None,
        metrics: BridgeMetrics,
        replicas: int,
        *,
        local_only: Callable[[str], bool],
        on_loaded: Callable[[Episode], None],
        on_dropped: Callable[[Episode], Awaitable[None]],
    ) -> None:
        self.store = store
        self.journal = journal
        self.metrics = metrics
        self.replicas = replicas
        self._local_only = local_only  # episodes that live in this process only (env sessions)
        self._on_loaded = on_loaded  # an episode this bridge did not hold was loaded
        self._on_dropped = on_dropped  # an episode ended through another bridge was dropped here
        self.leases_held = 0  # Step leases this bridge holds in Redis: a shutdown waits for 0 (BridgeServer.stop)

    def failed(self, what: str, exc: PersistenceUnavailable) -> None:
        """Fail the RPC (persistence.required) or fail open: log, count, go on in memory."""
        assert self.journal is not None
        if self.journal.config.required:
            raise exc
        self.metrics.fail_open.labels("persistence").inc()
        log.warning("episode persistence failed open (%s): %s", what, exc.message)

    async def save(self, episode: Episode) -> None:
        if self.journal is None or self._local_only(episode.id):
            return
        try:
            await asyncio.shield(self.journal.save(episode, episode.rev + 1))
        except PersistenceUnavailable as exc:
            self.failed("write", exc)
            return
        episode.rev += 1
        episode.persisted = True

    async def save_all(self, episodes: list[Episode]) -> None:
        """Write newly started episodes; if a required write fails, none of them stays open."""
        if self.journal is None:
            return
        try:
            for episode in episodes:
                await self.save(episode)
        except PersistenceUnavailable:
            for episode in episodes:
                if self.store.discard(episode.id) is not None:
                    await self._on_dropped(episode)
            raise

    async def delete(self, episode: Episode) -> None:
        """Delete an ending episode's record (first, so a failure changes nothing and the client may retry)."""
        if self.journal is None or not episode.persisted:
            return
        try:
            await self.journal.delete(episode.id)
        except PersistenceUnavailable as exc:
            self.failed("delete", exc)

    async def sync(self, episode_id: str) -> None:
        """Make the local copy match the persisted record (written by this or another bridge)."""
        if self.journal is None:
            return
        local = self.store.peek(episode_id)
        try:
            remote = await self.journal.revision(episode_id)
            if remote is None:
                if local is not None and local.persisted and not local.busy and await self.journal.ended(episode_id):
                    self.store.discard(episode_id)  # ended through another bridge
                    await self._on_dropped(local)
                elif local is not None:  # Redis lost the record (restarted empty): ours is rewritten at the turn end
                    local.persisted = False
                return
            if local is not None and local.rev >= remote:
                return
            loaded = await self.journal.load(episode_id)
        except PersistenceUnavailable as exc:
            self.failed("read", exc)
            return
        if loaded is None:
            return
        episode, rev = loaded
        episode.rev, episode.persisted = rev, True
        if episode.replica >= self.replicas:  # written by a bridge with more replicas: routing moves it
            episode.replica = 0
        if local is None:
            self._on_loaded(episode)
        self.store.add(episode)

    async def lease(self, episode_id: str) -> bool:
        """Hold the episode against Steps and ends on other bridges; False when there is nothing to release."""
        if self.journal is None:
            return False
        try:
            if await self.journal.acquire(episode_id):
                self.leases_held += 1
                return True
        except PersistenceUnavailable as exc:
            self.failed("lease", exc)
            return False
        raise EpisodeBusy(f"episode {episode_id!r} has a Step in progress (on this or another bridge)")

    async def unlease(self, episode_id: str) -> None:
        if self.journal is None:
            return
        try:
            await asyncio.shield(self.journal.release(episode_id))
        except PersistenceUnavailable as exc:  # the lease expires on its own
            log.warning("could not release the lease of episode %s: %s", episode_id, exc.message)
        finally:
            self.leases_held -= 1
