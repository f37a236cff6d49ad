"""HTTP sessions: a session is an episode of the bridge (or a GRPO group of them), owned by one tenant.

Invariants:
- sessions are keyed by (tenant, id): another tenant's session id is simply unknown to a caller (404),
  and two tenants may use the same ``X-Session-ID`` without meeting;
- a per-session API key (``sess-...``) is stored as its sha256 digest and resolves to exactly one session;
- at most one call runs per session (``busy``); a second one is refused (409), never queued or interleaved;
- a session's history is its episode's token ids; a call that does not extend them starts a new branch
  (a new episode, ``branches`` keeps the earlier ones) and is counted, never spliced;
- an ended session keeps its final trajectory for export until its TTL passes.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from core.errors import EpisodeBusy, InvalidArgument, NotFound, PrimeRLError
from core.types import NO_OVERRIDES, Origin, SamplingOverrides
from server.auth import hash_token
from server.bridge import Bridge
from server.calls import EndRequest
from server.episodes import Episode

MAX_ID_LENGTH = 128


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    group_size: int = 1
    sampling: SamplingOverrides = NO_OVERRIDES
    tools: tuple[str, ...] = ()  # JSON schemas of the session's tools (the bridge's tool_schemas)
    metadata: dict[str, str] = field(default_factory=dict)
    episode_ids: list[str] = field(default_factory=list)  # the current branch (group members in order)
    branches: list[list[str]] = field(default_factory=list)  # earlier branches, ended at the session's end
    messages: list[Any] | None = None  # chat: the conversation so far, the produced assistant turns included
    members: list[str] = field(default_factory=list)  # a group session: its members' session ids
    forks: int = 0
    busy: bool = False
    ended: dict[str, Any] | None = None  # the final trajectory JSON, once ended
    last_used: float = field(default_factory=time.monotonic)

    @property
    def started(self) -> bool:
        return bool(self.episode_ids)


def _lp(x: float) -> float | None:
    return None if math.isnan(x) else x


def trajectory_json(
    ep: Episode, rewards: tuple[float, ...] = (), turn_rewards: tuple[float, ...] = (), duration_ms: float | None = None
) -> dict[str, Any]:
    """An episode's trajectory as JSON: the content of gRPC ``EndEpisode``'s ``Trajectory``.

    ``logprobs`` is null where the policy did not sample; ``origins`` are the lower-case names of
    ``core.types.Origin``; ``loss_mask`` is 1 exactly for policy-sampled tokens.
    """
    out: dict[str, Any] = {
        "episode_id": ep.id,
        "group_id": ep.group_id,
        "group_index": ep.group_index,
        "model": ep.model,
        "token_ids": list(ep.token_ids),
        "logprobs": [_lp(x) for x in ep.logprobs],
        "loss_mask": [int(m) for m in ep.loss_mask],
        "origins": [Origin(o).name.lower() for o in ep.origins],
        "policy_versions": list(ep.versions),
        "prompt_length": ep.prompt_length,
        "turns": [
            {
                "index": t.index,
                "observation_start": t.observation_start,
                "generation_start": t.generation_start,
                "end": t.end,
                "policy_version": t.policy_version,
                "finish_reason": t.finish_reason.name.lower() if t.finish_reason is not None else None,
                "usage": {
                    "prompt_tokens": t.usage.prompt_tokens,
                    "cached_tokens": t.usage.cached_tokens,
                    "generated_tokens": t.usage.generated_tokens,
                },
                "latency_ms": t.latency_ms,
                "ttft_ms": t.ttft_ms,
            }
            for t in ep.turns
        ],
        "metadata": dict(ep.metadata),
        "rewards": list(rewards),
        "turn_rewards": list(turn_rewards),
    }
    if any(not math.isnan(x) for x in ep.raw_logprobs):
        out["raw_logprobs"] = [_lp(x) for x in ep.raw_logprobs]
    if any(not math.isnan(x) for x in ep.kept_logmass):
        out["kept_logmass"] = [_lp(x) for x in ep.kept_logmass]
    if duration_ms is not None:
        out["duration_ms"] = duration_ms
    return out


class SessionRegistry:
    """Open (and recently ended) sessions of one front door."""

    def __init__(self, bridge: Bridge, ttl_s: float) -> None:
        self.bridge = bridge
        self.ttl_s = ttl_s
        self._sessions: dict[tuple[str, str], Session] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # sha256(key) -> (tenant, session id)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @staticmethod
    def check_id(session_id: str) -> None:
        # ASCII: the id goes back in the X-Session-ID response header, which carries no other characters (a
        # printable non-ASCII id was accepted, the session created, and the response failed with a 500).
        if not session_id or len(session_id) > MAX_ID_LENGTH or not (session_id.isascii() and session_id.isprintable()):
            raise InvalidArgument(f"X-Session-ID must be 1 to {MAX_ID_LENGTH} printable ASCII characters")

    def find(self, tenant: str, session_id: str) -> Session | None:
        return self._sessions.get((tenant, session_id))

    def get(self, tenant: str, session_id: str) -> Session:
        session = self.find(tenant, session_id)
        if session is None:
            raise NotFound(f"session {session_id!r} does not exist (or belongs to another tenant)")
        return session

    def by_key(self, key: str) -> Session | None:
        where = self._keys.get(hash_token(key))
        return self._sessions.get(where) if where is not None else None

    async def create(self, tenant: str, session_id: str | None = None, **fields: Any) -> Session:
        await self.sweep()
        sid = session_id or "sess-" + secrets.token_hex(12)
        self.check_id(sid)
        if (tenant, sid) in self._sessions:
            raise InvalidArgument(f"session {sid!r} already exists")
        session = Session(id=sid, tenant=tenant, **fields)
        self._sessions[(tenant, sid)] = session
        return session

    def issue_key(self, session: Session) -> str:
        key = "sess-" + secrets.token_urlsafe(32)
        self._keys[hash_token(key)] = (session.tenant, session.id)
        return key

    def claim(self, session: Session) -> None:
        """Mark a call running on ``session`` (409 if one already is, or it has ended)."""
        if session.ended is not None:
            raise InvalidArgument(f"session {session.id!r} has ended; open a new one")
        if session.busy:
            raise EpisodeBusy(f"session {session.id!r} already has a call in progress; wait for it to finish")
        session.busy = True
        session.last_used = time.monotonic()

    def release(self, session: Session) -> None:
        session.busy = False
        session.last_used = time.monotonic()

    def episode(self, episode_id: str) -> Episode:
        ep = self.bridge.store.peek(episode_id)
        if ep is None:
            raise NotFound(f"episode {episode_id!r} of this session has already ended")
        return ep

    def trajectory(self, session: Session) -> dict[str, Any]:
        """The session's trajectory now (its final one once ended); a group lists its members'."""
        if session.ended is not None:
            return session.ended
        if session.members:
            return {
                "session_id": session.id,
                "sessions": list(session.members),
                "trajectories": [self.trajectory(self.get(session.tenant, m)) for m in session.members],
            }
        out: dict[str, Any] = {"session_id": session.id, "forks": session.forks}
        if session.episode_ids:
            out |= trajectory_json(self.episode(session.episode_ids[0]))
        out["branches"] = [trajectory_json(self.episode(b[0])) for b in session.branches if self._open(b[0])]
        return out

    def _open(self, episode_id: str) -> bool:
        return self.bridge.store.peek(episode_id) is not None

    async def end(
        self, session: Session, rewards: tuple[float, ...], turn_rewards: tuple[float, ...], discard: bool
    ) -> dict[str, Any]:
        """End the session's episodes (earlier branches too); returns the final trajectory JSON."""
        if session.ended is not None:
            return session.ended
        self.claim(session)
        try:
            if session.members:
                if rewards and len(rewards) != len(session.members):
                    raise InvalidArgument(
                        f"rewards has {len(rewards)} entries but the group has {len(session.members)} members"
                    )
                for i, m in enumerate(session.members):
                    member = self.get(session.tenant, m)
                    await self.end(member, (rewards[i],) if rewards else (), (), discard)
                result = self.trajectory(session)
            else:
                result = await self._end_episodes(session, rewards, turn_rewards, discard)
            session.ended = result
            return result
        finally:
            self.release(session)

    async def _end_episodes(
        self, session: Session, rewards: tuple[float, ...], turn_rewards: tuple[float, ...], discard: bool
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"session_id": session.id, "forks": session.forks, "branches": []}
        for branch in session.branches:
            ended = await self.bridge.end_episode(EndRequest(branch[0], tenant=session.tenant, discard=discard))
            if ended.episode is not None:
                out["branches"].append(trajectory_json(ended.episode, duration_ms=ended.duration_ms))
        if session.episode_ids:
            req = EndRequest(session.episode_ids[0], rewards, turn_rewards, discard, session.tenant)
            ended = await self.bridge.end_episode(req)
            if ended.episode is not None:
                out |= trajectory_json(ended.episode, ended.rewards, ended.turn_rewards, ended.duration_ms)
        return out

    async def sweep(self) -> None:
        """Discard sessions untouched for ``ttl_s`` (their episodes are freed without a trajectory)."""
        now = time.monotonic()
        for key, s in list(self._sessions.items()):
            if s.busy or now - s.last_used < self.ttl_s:
                continue
            del self._sessions[key]
            if s.ended is not None or s.members:  # nothing of its own left open
                continue
            for ep in [*s.episode_ids[:1], *(b[0] for b in s.branches)]:
                with contextlib.suppress(PrimeRLError):  # already ended through gRPC: nothing left to free
                    await self.bridge.end_episode(EndRequest(ep, tenant=s.tenant, discard=True))
        live = set(self._sessions)
        self._keys = {k: v for k, v in self._keys.items() if v in live}
