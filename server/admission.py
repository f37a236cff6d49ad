"""Admission: what the bridge refuses before it accepts work (nothing is written for a refused call).

- in-flight Steps, bridge-wide and per tenant (RESOURCE_EXHAUSTED with a retry-after);
- staleness (DESIGN invariant 4): a Step on an episode that started more than ``max_staleness``
  policy versions before the current one is refused with FAILED_PRECONDITION naming both versions,
  so off-policy data is never silently mixed into a trajectory (0 = off);
- sampling parameters the engine can honour; context and episode length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from core.types import EngineInfo, SamplingParams, check_capabilities
from observability.metrics import BridgeMetrics
from server.config import AdmissionConfig
from server.episodes import Episode
from server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from server.adapters import Adapters

RETRY_AFTER_S = 0.1


class Admission:
    """The admission limits of one bridge and its count of Steps in flight."""

    def __init__(self, config: AdmissionConfig, info: EngineInfo, metrics: BridgeMetrics) -> None:
        self.config = config
        self.info = info
        self.metrics = metrics
        self.inflight: dict[str, int] = {}  # tenant -> Steps running

    def enter(self, tenant: str) -> None:
        """Count a Step in, or refuse it when a limit is reached."""
        total = sum(self.inflight.values())
        if total >= self.config.max_inflight_steps:
            raise ResourceExhausted(
                f"{total} Steps are running, the limit of admission.max_inflight_steps; retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )
        limit = self.config.max_inflight_steps_per_tenant
        if limit and self.inflight.get(tenant, 0) >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {limit} Steps running, its limit; retry shortly", retry_after_s=RETRY_AFTER_S
            )
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        left = self.inflight[tenant] - 1
        if left:
            self.inflight[tenant] = left
        else:
            del self.inflight[tenant]

    def check_fresh(self, episode: Episode, version: Callable[[], int], adapters: Adapters | None = None) -> None:
        """Refuse a Step on an episode more than ``max_staleness`` versions behind the current ``version()`` (an
        episode on a LoRA adapter: its adapter's, which must still be loaded: InvalidArgument otherwise)."""
        adapter = adapters.ref(episode.adapter) if episode.adapter and adapters is not None else None
        bound = self.config.max_staleness
        if not bound:
            return
        current = adapter.version if adapter is not None else version()
        if current - episode.start_version > bound:
            self.metrics.staleness_rejections.labels(self.info.model).inc()
            raise FailedPrecondition(
                f"episode {episode.id!r} started at policy version {episode.start_version}, "
                f"{current - episode.start_version} versions behind the current version {current} "
                f"(admission.max_staleness = {bound}); end it and start a new one"
            )

    def check_sampling(self, params: SamplingParams) -> None:
        """InvalidArgument naming the bad field; Unimplemented naming the engine and capability (e.g. min_p)."""
        params.validate(self.info.vocab_size)
        check_capabilities(self.info, params)
        if params.max_tokens > self.config.max_tokens_per_turn:
            raise InvalidArgument(
                f"sampling.max_tokens = {params.max_tokens} exceeds the limit of "
                f"{self.config.max_tokens_per_turn} tokens per turn"
            )
        if params.max_tokens >= self.info.max_model_len:
            raise InvalidArgument(
                f"sampling.max_tokens = {params.max_tokens} does not fit the context window of "
                f"{self.info.max_model_len} tokens"
            )

    def check_length(self, total: int, what: str) -> None:
        if total >= self.info.max_model_len:
            raise InvalidArgument(
                f"{what} of {total} tokens leaves no room in the context window of {self.info.max_model_len} tokens"
            )
        if total >= self.config.max_tokens_per_episode:
            raise ResourceExhausted(
                f"{what} of {total} tokens reaches the limit of {self.config.max_tokens_per_episode} tokens per episode"
            )
