"""Engine configuration: which engine runs, where, and its own knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EngineType = Literal["toy", "embedded", "vllm", "sglang", "trtllm"]


class ToyConfig(BaseModel):
    """The deterministic n-gram engine used by fast tests and benchmarks."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(512, ge=16, le=65536, description="Vocabulary size, special tokens included.")
    seed: int = Field(0, ge=0, description="Seed of the model's probability tables (same seed = same model).")
    max_model_len: int = Field(4096, ge=16, description="Context window in tokens.")
    end_bias: float = Field(
        -1.0, description="Logit bias of the end-of-turn token; higher means shorter turns (about 20 tokens at -1)."
    )
    yield_every: int = Field(
        16,
        ge=1,
        le=4096,
        description="Emit a chunk and yield to the event loop every this many tokens (fairness vs overhead).",
    )
    supports_weight_updates: bool = Field(
        True, description="Whether UpdateWeights is accepted (off to exercise engines that cannot reload)."
    )
    token_delay_s: float = Field(
        0.0, ge=0, le=10, description="Simulated time per generated token (to exercise cancellation and deadlines)."
    )


class EngineConfig(BaseModel):
    """Which engine serves the model. ``type`` picks the implementation."""

    model_config = ConfigDict(extra="forbid")

    type: EngineType = Field("toy", description="Engine implementation.")
    model: str = Field("", description="Model name served; empty uses the engine's own default name.")
    urls: list[str] = Field(
        default_factory=list, description="Replica base URLs for remote engines (vllm, sglang, trtllm)."
    )
    replicas: int = Field(1, ge=1, le=64, description="Number of in-process replicas (toy, embedded).")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Upper bound on one engine call; the RPC deadline applies when shorter."
    )
    toy: ToyConfig = Field(default_factory=ToyConfig, description="Settings of the toy engine.")
