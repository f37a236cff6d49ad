"""The ``[inspector]`` section: the live inspector's bounded memory of episodes and its event streams."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class InspectorConfig(BaseModel):
    """The live inspector (``/ui`` and ``/v1/inspect/*``): what it remembers of ended episodes, and its streams.

    Its memory is bounded twice: at most ``max_ended_episodes`` ended episodes and at most ``max_ended_bytes``
    of their encoded records, the oldest evicted first. The bridge's RSS grows by about ``max_ended_bytes``
    plus ~1 KiB per kept episode, no more, however many episodes end (bench/inspector.py measures it).

    With ``persistence.enabled``, each ended episode is also written to that Redis (a background writer, off the
    bridge's hot path; dropped and counted when Redis is down or slow) and kept there ``ended_ttl_s``, at most
    ``max_ended_episodes`` per tenant: a restarted bridge, or another on the same Redis, still shows them.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Record episodes for the inspector; off: /v1/inspect/* answer 404 and nothing is kept."
    )
    max_ended_episodes: int = Field(
        2000, ge=0, le=1_000_000, description="Ended episodes kept in memory for the page (oldest evicted first)."
    )
    max_ended_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        le=64 * 1024**3,
        description="Bytes of encoded ended episodes kept in memory (token arrays packed); oldest evicted first.",
    )
    ended_ttl_s: int = Field(
        86400,
        ge=60,
        le=30 * 86400,
        description="With persistence on: how long Redis keeps an ended episode for the page (its keys' TTL).",
    )
    subscriber_queue: int = Field(
        256,
        ge=8,
        le=65536,
        description="Events buffered per live page; a slower page drops the oldest and is told to refetch.",
    )
    heartbeat_s: float = Field(
        15.0, gt=0, le=300, description="A live stream with no event this long gets a comment line (keeps proxies)."
    )
    retry_ms: int = Field(
        1000, ge=100, le=60_000, description="The `retry:` a live stream announces: how soon a page reconnects."
    )
