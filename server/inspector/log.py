"""``EpisodeLog``: what the live inspector knows of one bridge's episodes, weight updates and replicas.

The bridge calls it at the few points every surface (gRPC, the HTTP front door, env episodes) goes through:
episodes started, a Step accepted, a Step released, an episode ended, a weight update, a pause and a resume. Open
episodes stay in the bridge's store (the log keeps only each one's request ids and replicas per turn); an ended
episode is kept here as two byte strings, its summary (JSON) and its record (``server.persistence.encode``:
token arrays packed), so its size is known exactly.

Invariants:
- the hooks never wait and never raise into the bridge; with ``enabled`` off they return at once;
- ended episodes are bounded by count (``max_ended_episodes``) and bytes (``max_ended_bytes``), oldest first;
- nothing here changes an episode;
- with a ``store`` (persistence on), each ended episode is also queued for Redis (``EndedStore.put``: no wait).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.episodes import Episode
from server.inspector.config import InspectorConfig
from server.inspector.events import EventHub
from server.inspector.store import Ended, EndedStore
from server.persistence import decode, encode
from server.requestid import current_request_id

MAX_REQUEST_IDS = 16  # per episode: the first one and the latest ones
UPDATES_KEPT = 20


@dataclass(slots=True)
class LiveInfo:
    """What the log adds to an open episode: the calls that drove it and the replica of each turn."""

    request_ids: list[str] = field(default_factory=list)
    turn_replicas: list[int] = field(default_factory=list)

    def add_request(self, rid: str) -> None:
        if rid and (not self.request_ids or self.request_ids[-1] != rid):
            self.request_ids.append(rid)
            if len(self.request_ids) > MAX_REQUEST_IDS:
                del self.request_ids[1]


def wall_clock(episode: Episode) -> float:
    """Unix time the episode started (its ``created`` is a perf_counter reading)."""
    return time.time() - (time.perf_counter() - episode.created)


def summarize(episode: Episode, status: str, info: LiveInfo | None) -> dict[str, Any]:
    """One row of the episode list (O(turns), never O(tokens))."""
    turns = episode.turns
    last = turns[-1] if turns else None
    meta = episode.metadata
    return {
        "id": episode.id,
        "tenant": episode.tenant,
        "model": episode.model,
        "group_id": episode.group_id,
        "group_index": episode.group_index,
        "session_id": meta.get("http.session", ""),
        "branch": int(meta.get("http.forks", "0") or 0) if "http.session" in meta else None,
        "status": status,
        "turns": len(turns),
        "tokens": len(episode.token_ids),
        "sampled_tokens": sum(t.end - t.generation_start for t in turns),
        "prompt_tokens": episode.prompt_length,
        "started_at": wall_clock(episode),
        "policy_versions": [episode.versions[0], episode.versions[-1]] if episode.versions else [],
        "replica": episode.replica,
        "finish_reason": last.finish_reason.name.lower() if last and last.finish_reason is not None else None,
        "request_ids": list(info.request_ids) if info else [],
        "turn_replicas": list(info.turn_replicas) if info else [],
    }


class EpisodeLog:
    """See module docstring."""

    def __init__(self, config: InspectorConfig, store: EndedStore | None = None) -> None:
        self.config = config
        self.store = store if config.enabled else None  # ended episodes in Redis (persistence on)
        self.enabled = config.enabled
        self.hub = EventHub(config.subscriber_queue)
        self._live: dict[str, LiveInfo] = {}
        self._starts = 0
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self.ended_bytes = 0
        self.evicted = 0
        self.cache: dict[int, list[int]] = {}  # replica -> [turns, prompt tokens, cached tokens]
        self.updates: deque[dict[str, Any]] = deque(maxlen=UPDATES_KEPT)
        self.paused_since: float | None = None  # unix time of the current pause

    # -- bridge hooks ---------------------------------------------------------------------

    def started(self, episode_ids: Sequence[str], peek: Callable[[str], Episode | None]) -> None:
        """Episodes (a group) started; ``peek``: the bridge's open episode by id."""
        if not self.enabled:
            return
        self._starts += 1
        if self._starts % 1024 == 0:  # forget episodes that left this bridge another way (moved to another bridge)
            self._live = {k: v for k, v in self._live.items() if peek(k) is not None}
        rid = current_request_id.get()
        for ep in filter(None, map(peek, episode_ids)):
            info = self._live[ep.id] = LiveInfo()
            info.add_request(rid)
            self.hub.publish("episode_started", ep.tenant, summarize(ep, "idle", info))

    def step_started(self, episode: Episode) -> None:
        if not self.enabled:
            return
        info = self._live.setdefault(episode.id, LiveInfo())
        info.add_request(current_request_id.get())
        self.hub.publish("step_started", episode.tenant, summarize(episode, "running", info))

    def step_ended(self, episode: Episode, first_turn: int) -> None:
        """A Step released its episode; ``first_turn``: the index of the first turn it opened."""
        if not self.enabled:
            return
        info = self._live.setdefault(episode.id, LiveInfo())
        for turn in episode.turns[first_turn:]:
            counts = self.cache.setdefault(episode.replica, [0, 0, 0])
            counts[0] += 1
            counts[1] += turn.usage.prompt_tokens
            counts[2] += turn.usage.cached_tokens
        del info.turn_replicas[min(first_turn, len(info.turn_replicas)) :]
        info.turn_replicas.extend([episode.replica] * (len(episode.turns) - len(info.turn_replicas)))
        self.hub.publish("step_ended", episode.tenant, summarize(episode, "idle", info))

    def ended(
        self,
        episode: Episode,
        rewards: Sequence[float],
        turn_rewards: Sequence[float],
        duration_ms: float,
        discarded: bool,
    ) -> None:
        if not self.enabled:
            return
        info = self._live.pop(episode.id, None)
        summary = summarize(episode, "discarded" if discarded else "ended", info)
        summary |= {"ended_at": time.time(), "duration_ms": duration_ms, "rewards": list(rewards)}
        summary["turn_rewards"] = list(turn_rewards)
        entry = Ended(episode.tenant, json.dumps(summary, separators=(",", ":")).encode(), encode(episode, 0))
        self._keep(episode.id, entry)
        if self.store is not None:
            self.store.put(episode.id, summary["ended_at"], entry)
        self.hub.publish("episode_ended", episode.tenant, summary)

    def weights_updated(self, previous: int, version: int, began: float, duration_s: float) -> None:
        """A weight update reached the replicas (``began``: unix time)."""
        if not self.enabled:
            return
        update = {
            "at": began,
            "previous_version": previous,
            "version": version,
            "duration_ms": duration_s * 1e3,
            "paused_ms": None,  # set at the resume of a pause it ran in
            "in_pause": self.paused_since is not None,
        }
        self.updates.append(update)
        self.hub.publish("weights_updated", None, update)

    def paused(self) -> None:
        if self.enabled and self.paused_since is None:
            self.paused_since = time.time()
            self.hub.publish("paused", None, {"at": self.paused_since})

    def resumed(self) -> None:
        if not self.enabled or self.paused_since is None:
            return
        now = time.time()
        paused_ms = (now - self.paused_since) * 1e3
        for update in self.updates:
            if update["in_pause"] and update["paused_ms"] is None:
                update["paused_ms"] = paused_ms
        self.paused_since = None
        self.hub.publish("resumed", None, {"at": now, "paused_ms": paused_ms})

    # -- ended episodes -------------------------------------------------------------------

    def _keep(self, episode_id: str, entry: Ended) -> None:
        old = self._ended.pop(episode_id, None)
        if old is not None:
            self.ended_bytes -= old.size
        self._ended[episode_id] = entry
        self.ended_bytes += entry.size
        cap, budget = self.config.max_ended_episodes, self.config.max_ended_bytes
        while self._ended and (len(self._ended) > cap or self.ended_bytes > budget):
            _, gone = self._ended.popitem(last=False)
            self.ended_bytes -= gone.size
            self.evicted += 1

    @property
    def ended_count(self) -> int:
        return len(self._ended)

    def ended_entries(self) -> Iterator[tuple[str, Ended]]:
        """Newest first."""
        return reversed(list(self._ended.items()))

    def ended_entry(self, episode_id: str) -> Ended | None:
        return self._ended.get(episode_id)

    def live_info(self, episode_id: str) -> LiveInfo | None:
        return self._live.get(episode_id)

    def replica_cache(self, replica: int) -> dict[str, Any]:
        turns, prompt, cached = self.cache.get(replica, [0, 0, 0])
        return {"turns": turns, "prompt_tokens": prompt, "cached_tokens": cached,
                "hit_rate": cached / prompt if prompt else None}  # fmt: skip

    def close(self) -> None:
        self.hub.close()

    async def close_store(self) -> None:
        """Write the ended episodes still queued for Redis (bounded by its timeout), then stop the writer."""
        if self.store is not None:
            await self.store.close()


def load_ended(entry: Ended) -> tuple[dict[str, Any], Episode]:
    """An ended entry's summary and episode."""
    summary: dict[str, Any] = json.loads(entry.summary)
    return summary, decode(entry.record)[0]
