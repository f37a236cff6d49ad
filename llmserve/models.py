"""The wire types: ``ServeAction``, ``ServeObservation``, ``ServeState`` and ``EpisodeLog``.

They subclass openenv-core's ``Action`` / ``Observation`` / ``State`` (pydantic; actions forbid
unknown fields). A value out of range fails validation before the environment sees it, with an
error that names the field and its range, so a rejected step changes nothing in the episode.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from llmserve.profiles import QuantTier

_RANGES: dict[str, tuple[float, float]] = {
    "batch_cap": (1, 512),
    "kv_budget_fraction": (0.1, 1.0),
    "speculation_depth": (0, 8),
}


class ServeAction(Action):
    """The serving configuration applied for the next window."""

    batch_cap: int = Field(default=64, ge=1, le=512, description="max sequences decoded together (1..512)")
    kv_budget_fraction: float = Field(
        default=0.9, ge=0.1, le=1.0, description="fraction of free GPU memory reserved for KV (0.1..1.0)"
    )
    speculation_depth: int = Field(default=0, ge=0, le=8, description="draft tokens per target step (0..8)")
    quantization_tier: QuantTier = Field(default=QuantTier.FP16, description="weight precision: FP16|INT8|INT4")
    prefill_decode_split: bool = Field(default=False, description="run prefill on a second GPU (DistServe-style)")
    priority_routing: bool = Field(default=False, description="serve priority-0 requests first; evict priority 1")

    @field_validator("batch_cap", "kv_budget_fraction", "speculation_depth", mode="before")
    @classmethod
    def _in_range(cls, value: Any, info: Any) -> Any:
        lo, hi = _RANGES[info.field_name]
        kind = "an integer" if info.field_name != "kv_budget_fraction" else "a number"
        bad = isinstance(value, bool) or not isinstance(value, int | float)
        if bad or not lo <= value <= hi or (kind == "an integer" and value != int(value)):
            # PydanticCustomError, not ValueError: its error context stays JSON-serialisable in the 422.
            raise PydanticCustomError(
                "out_of_range",
                "{field} must be {kind} in {range}, got {value}",
                {"field": info.field_name, "kind": kind, "range": f"{lo:g}..{hi:g}", "value": repr(value)},
            )
        return value


class ServeObservation(Observation):
    """What the agent sees after a window (latencies over the requests of that window)."""

    queue_depth: int = Field(default=0, ge=0, description="requests waiting for admission")
    active_requests: int = Field(default=0, ge=0, description="requests holding KV (prefilling or decoding)")
    kv_cache_occupancy: float = Field(default=0.0, ge=0.0, le=1.0, description="used / reserved KV tokens")
    mean_prompt_length: float = Field(default=0.0, ge=0.0, description="mean prompt tokens of this window's arrivals")
    p50_ttft_ms: float = Field(default=0.0, ge=0.0, description="median time to first token")
    p99_ttft_ms: float = Field(default=0.0, ge=0.0, description="99th percentile time to first token")
    p50_itl_ms: float = Field(default=0.0, ge=0.0, description="median inter-token latency of finished requests")
    throughput_tps: float = Field(default=0.0, ge=0.0, description="output tokens per second")
    slo_compliance_rate: float = Field(default=1.0, ge=0.0, le=1.0, description="judged requests meeting SLOs")
    gpu_memory_used_gb: float = Field(default=0.0, ge=0.0, description="weights + activations + used KV (GB)")
    estimated_cost_per_1k: float = Field(default=0.0, ge=0.0, description="USD per 1k output tokens")
    request_arrival_rate: float = Field(default=0.0, ge=0.0, description="arrivals per second this window")
    spec_acceptance_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="draft acceptance (0 if off)")
    eviction_events: int = Field(default=0, ge=0, description="sequences preempted for KV this window")
    step_index: int = Field(default=0, ge=0, description="windows completed in this episode")
    task_id: str = Field(default="", description="the episode's task")


class EpisodeLog(BaseModel):
    """Everything needed to replay and grade an episode: the task, the seed and the actions."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    seed: int = Field(ge=0)
    actions: list[dict[str, Any]] = Field(default_factory=list, description="ServeAction fields per step")
    rewards: list[float] = Field(default_factory=list, description="rewards as observed (checked on replay)")


class ServeState(State):
    """The episode's state; ``episode_log`` is what ``/grader`` accepts."""

    task_id: str = ""
    seed: int = 0
    episode_length: int = 0
    done: bool = False
    total_reward: float = 0.0
    episode_log: EpisodeLog | None = None


def action_fields(action: ServeAction) -> dict[str, Any]:
    """The action as a plain JSON dict (no ``metadata``): one entry of an episode log."""
    return action.model_dump(mode="json", exclude={"metadata"})
