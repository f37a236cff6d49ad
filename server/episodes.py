"""Episode state and the in-process episode store.

Invariants:
- an episode's arrays (token ids, logprobs, origins, versions) always have equal length and
  hold exactly the ids its engine saw, in order; tokens are appended as they stream, so a
  cancelled or failed turn keeps its partial tokens;
- at most one Step runs per episode (``busy``); a second one is refused, not queued;
- episode ids are unguessable (128 random bits).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from core.types import AdapterRef, FinishReason, Origin, SamplingParams, Usage
from server.errors import NotFound, PermissionDenied, ResourceExhausted

NAN = math.nan


@dataclass(slots=True)
class Turn:
    """Boundaries and outcome of one turn (indices into the episode's arrays)."""

    index: int
    observation_start: int
    generation_start: int
    end: int
    policy_version: int
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    started: float = field(default_factory=time.perf_counter)
    latency_ms: float = 0.0
    ttft_ms: float = 0.0
    # The prefix-cache salt its engine request carries (``core.salt``), built once per turn: the one it was routed
    # with. Not persisted: a closed turn needs none.
    cache_salt: str = field(default="", compare=False)
    # The LoRA adapter version the turn runs on, held from open to close (``server.adapters``). Not persisted.
    adapter: AdapterRef | None = field(default=None, compare=False)


@dataclass(eq=False, slots=True)
class Episode:
    id: str
    tenant: str
    model: str
    group_id: str
    group_index: int
    replica: int
    sampling: SamplingParams
    metadata: dict[str, str]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)  # NaN where not sampled or not asked for
    kept_logmass: list[float] = field(default_factory=list)  # log kept mass; NaN where not sampled or not asked for
    origins: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_length: int = 0
    turns: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.perf_counter)
    busy: bool = False
    # A GRPO group (or an explicit group id): engines may share the prompt's KV among its members.
    shares_prompt: bool = False
    tool_schemas: tuple[str, ...] = ()  # JSON schemas of the episode's tools (speculation drafts calls to them)
    adapter: str = ""  # the LoRA adapter it samples with ("": the base model); its tokens carry the adapter's versions
    rev: int = 0  # revision of the persisted record this copy matches (server.persistence)
    persisted: bool = False

    def append(
        self,
        ids: Iterable[int],
        logprobs: Iterable[float],
        origins: Iterable[int],
        version: int,
        raw_logprobs: Sequence[float] = (),
        kept_logmass: Sequence[float] = (),
    ) -> int:
        """Append tokens with their metadata; returns how many were appended."""
        before = len(self.token_ids)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.origins.extend(origins)
        n = len(self.token_ids) - before
        self.versions.extend([version] * n)
        self.raw_logprobs.extend(raw_logprobs if len(raw_logprobs) == n else [NAN] * n)
        self.kept_logmass.extend(kept_logmass if len(kept_logmass) == n else [NAN] * n)
        return n

    def append_unsampled(self, ids: list[int], origin: Origin, version: int) -> None:
        """Append prompt or environment tokens (logprob NaN, never trained on)."""
        self.append(ids, [NAN] * len(ids), [int(origin)] * len(ids), version)

    @property
    def group_key(self) -> str:
        """Group ids are the client's, so they are scoped by tenant wherever they key shared state."""
        return f"{self.tenant}/{self.group_id}"

    @property
    def routing_group(self) -> str:
        """The group engines and routing co-locate (its members share the prompt's KV), or ""."""
        return f"{self.tenant}/{self.group_id}" if self.shares_prompt else ""

    @property
    def start_version(self) -> int:
        """The policy version the episode started at (its prompt's), which staleness admission compares."""
        return self.versions[0] if self.versions else 0

    @property
    def loss_mask(self) -> list[bool]:
        return [Origin(o).policy_sampled for o in self.origins]


class EpisodeStore:
    """Open episodes by id, with the admission limit on how many may be open."""

    def __init__(self, max_episodes: int) -> None:
        self.max_episodes = max_episodes
        self._episodes: dict[str, Episode] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    def __iter__(self) -> Iterator[Episode]:
        return iter(list(self._episodes.values()))

    id_prefix = "ep-"  # a bridge worker's store sets its own (server.fleet.workers: ids name their owner)

    def new_id(self) -> str:
        return self.id_prefix + secrets.token_hex(16)

    def admit(self, count: int, tenant: str = "", per_tenant: int = 0) -> None:
        """Raise ResourceExhausted unless ``count`` more episodes fit (bridge-wide, and for ``tenant``)."""
        if len(self._episodes) + count > self.max_episodes:
            raise ResourceExhausted(
                f"{count} new episode(s) would exceed the limit of {self.max_episodes} open episodes "
                f"({len(self._episodes)} open); end finished episodes or raise admission.max_episodes",
                retry_after_s=1.0,
            )
        if per_tenant:
            mine = sum(1 for e in self._episodes.values() if e.tenant == tenant)
            if mine + count > per_tenant:
                raise ResourceExhausted(
                    f"{count} new episode(s) would exceed the limit of {per_tenant} open episodes of tenant "
                    f"{tenant!r} ({mine} open); end finished episodes first",
                    retry_after_s=1.0,
                )

    def add(self, episode: Episode) -> None:
        self._episodes[episode.id] = episode

    def get(self, episode_id: str, tenant: str) -> Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise NotFound(f"episode {episode_id!r} does not exist or has already ended")
        if episode.tenant != tenant:
            raise PermissionDenied(f"episode {episode_id!r} belongs to another tenant")
        return episode

    def peek(self, episode_id: str) -> Episode | None:
        """The local copy, without the tenant check (for syncing with the persisted record)."""
        return self._episodes.get(episode_id)

    def discard(self, episode_id: str) -> Episode | None:
        return self._episodes.pop(episode_id, None)

    def pop(self, episode_id: str, tenant: str) -> Episode:
        episode = self.get(episode_id, tenant)
        del self._episodes[episode_id]
        return episode
