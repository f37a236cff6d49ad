"""Scoring by episode id: the verifier ends the episode on a bridge (``--bridge HOST:PORT``) and grades its trajectory.

The bridge offers no read-only trajectory RPC: the one way to read an episode's token record is
``EndEpisode``, which also frees the episode. So an ``episode_id`` score request *ends* the episode on
the bridge (without rewards: the verdict is the reward) and returns the trajectory to the caller, who
must not end it itself. A trainer that ends its episodes itself submits ``EndEpisode``'s returned
trajectory instead (``ScoreRequest.trajectory``); both sign the same subject digest.
"""

from __future__ import annotations

import math
from typing import Any

from core.errors import FailedPrecondition, PrimeRLError, error_class
from rl_client import AsyncBridgeClient, BridgeError
from rl_client.types import Trajectory as BridgeTrajectory


class BridgeRefused(PrimeRLError):
    """The bridge answered EndEpisode with an error: its status is this item's (NOT_FOUND for an unknown episode),
    with the HTTP status of that code's class (``core.errors.error_class``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = error_class(code).http_status


def verifier_trajectory(t: BridgeTrajectory) -> dict[str, Any]:
    """The token record of a bridge trajectory as the verifier's ``Trajectory`` JSON (NaN logprob -> null)."""
    return {
        "episode_id": t.episode_id,
        "token_ids": [int(x) for x in t.token_ids],
        "logprobs": [None if math.isnan(x) else float(x) for x in t.logprobs],
        "loss_mask": [int(x) for x in t.loss_mask],
        "origins": [int(x) for x in t.origins],
        "policy_versions": [int(x) for x in t.policy_versions],
    }


class BridgeSource:
    """Ends episodes on one bridge to score them (one channel, opened lazily on the serving loop)."""

    def __init__(self, target: str, timeout_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._client: AsyncBridgeClient | None = None

    async def end_episode(self, episode_id: str) -> BridgeTrajectory:
        if not episode_id:
            raise BridgeRefused("INVALID_ARGUMENT", "episode_id: empty")
        if self._client is None:
            self._client = AsyncBridgeClient(self.target, timeout=self.timeout_s)
        try:
            return await self._client.end_episode(episode_id)
        except BridgeError as exc:
            code = exc.code.name if exc.code.name in ("NOT_FOUND", "INVALID_ARGUMENT", "PERMISSION_DENIED") else ""
            raise BridgeRefused(
                code or "UNAVAILABLE", f"episode_id: the bridge at {self.target} refused EndEpisode: {exc.details}"
            ) from None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def no_bridge() -> FailedPrecondition:
    return FailedPrecondition("episode_id: this verifier has no bridge to end episodes on (start it with --bridge)")
