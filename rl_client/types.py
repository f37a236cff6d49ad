"""Plain Python results of the trainer client (numpy arrays, no protobuf)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

# ``Started`` (start_episode's result) and ``EnvStatus`` (a Step's tool-loop state) are the bridge's own result
# types, shared with the server (core.types) and re-exported here.
from core.types import EnvStatus as EnvStatus
from core.types import SamplingOverrides
from core.types import Started as Started

# Sampling parameters a call sets, e.g. ``Sampling(temperature=0.7, max_tokens=64)``; the rest inherit
# (turn <- episode <- server defaults). The fields are those of ``core.types.SamplingParams``, the one
# sampling type from this client to the engine (an unknown name is a TypeError listing the fields).
Sampling = SamplingOverrides
FinishReason = Literal["stop", "length", "abort", "unspecified"]
ORIGINS = ("unspecified", "prompt", "env", "sampled", "draft_accepted", "resampled", "forced")
FINISH_REASONS: tuple[FinishReason, ...] = ("unspecified", "stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    name: str = ""


Prompt = Sequence[int] | Sequence[Message] | Sequence[Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of a streamed turn; ``done`` is set on the last chunk."""

    token_ids: list[int]
    logprobs: list[float]
    origins: list[str]
    text: str
    done: TurnResult | None = None
    raw_logprobs: list[float] = field(default_factory=list)  # only when sampling.raw_logprobs was set
    kept_logmass: list[float] = field(default_factory=list)  # only when sampling.kept_mass was set


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One completed turn."""

    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    origins: list[str]
    text: str
    finish_reason: FinishReason
    usage: Usage
    policy_version: int
    turn_index: int
    raw_logprobs: npt.NDArray[np.float32] | None = None  # only when sampling.raw_logprobs was set
    kept_logmass: npt.NDArray[np.float32] | None = None  # only when sampling.kept_mass was set
    # Episodes with an environment: the tool loop's state. The arrays then hold every token of the
    # Step in order (each turn's sampled tokens and the tool results between them, origin "env").
    env: EnvStatus | None = None


@dataclass(frozen=True, slots=True)
class TurnInfo:
    observation_start: int
    generation_start: int
    end: int
    finish_reason: FinishReason
    usage: Usage
    policy_version: int
    latency_ms: float
    ttft_ms: float


@dataclass(frozen=True)
class Trajectory:
    """The exact token-level record of an episode; all arrays have one entry per token."""

    episode_id: str
    group_id: str
    group_index: int
    model: str
    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    loss_mask: npt.NDArray[np.bool_]
    origins: npt.NDArray[np.int8]
    policy_versions: npt.NDArray[np.int64]
    prompt_length: int
    turns: list[TurnInfo]
    rewards: list[float]
    turn_rewards: list[float]
    metadata: dict[str, str] = field(default_factory=dict)
    duration_ms: float = 0.0
    # Raw (temperature-1) logprobs, NaN where not sampled or not asked; None if no turn asked for them.
    raw_logprobs: npt.NDArray[np.float32] | None = None
    # Log of the probability mass the sampler kept (0: nothing cut; logprobs + kept_logmass = the untruncated
    # temperature-scaled logprob), NaN where not sampled or not asked; None if no turn asked (sampling.kept_mass).
    kept_logmass: npt.NDArray[np.float32] | None = None
    adapter: str = ""  # the LoRA adapter every token was sampled with ("": the base); policy_versions are its versions

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def reward(self) -> float:
        return self.rewards[0] if self.rewards else 0.0

    def origin_names(self) -> list[str]:
        return [ORIGINS[o] for o in self.origins]
