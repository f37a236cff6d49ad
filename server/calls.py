"""The bridge's calls as typed objects: what ``server.service`` builds from protobuf for ``server.bridge.Bridge``,
and what the bridge hands back. Frozen, so a request is validated once and never changes under the bridge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.types import NO_OVERRIDES, Message, Origin, SamplingOverrides, Started
from server.envsession import EnvOutcome
from server.episodes import Episode, Turn

# ``SamplingOverrides`` (the fields a request sets) and ``NO_OVERRIDES`` are core.types' partial form of
# ``SamplingParams``, re-exported here for the bridge's calls.


@dataclass(frozen=True, slots=True)
class StartRequest:
    model: str = ""
    prompt_ids: tuple[int, ...] | None = None
    prompt_messages: tuple[Message, ...] | None = None
    tool_schemas: tuple[str, ...] = ()
    sampling: SamplingOverrides = NO_OVERRIDES
    group_size: int = 1
    group_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    tenant: str = ""
    env: str = ""  # an env hub environment: it supplies the prompt and Step runs its tool loop
    env_task_id: str = ""
    env_seed: int | None = None
    adapter: str = ""  # a loaded LoRA adapter to sample with ("": the base model, unless ``model`` names an adapter)


# What StartEpisode hands back: the trainer client's own result type (``rl_client.Started``).
StartResult = Started


@dataclass(frozen=True, slots=True)
class StepRequest:
    episode_id: str
    observation_ids: tuple[int, ...] | None = None
    observation_messages: tuple[Message, ...] | None = None
    sampling: SamplingOverrides = NO_OVERRIDES
    tenant: str = ""
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """Tokens appended to the episode since the last update.

    ``turn`` is set on an update that closes a turn; ``last`` is False when the tool loop
    samples another turn in the same Step. The Step's final update has ``turn`` and ``last``
    (and ``env`` for episodes with an environment).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    origins: tuple[Origin, ...]
    turn: Turn | None = None
    raw_logprobs: tuple[float, ...] = ()
    last: bool = True
    env: EnvOutcome | None = None
    kept_logmass: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class EndRequest:
    episode_id: str
    rewards: tuple[float, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    discard: bool = False
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class EndResult:
    episode: Episode | None  # None for a discarded episode (no trajectory is built)
    rewards: tuple[float, ...]
    turn_rewards: tuple[float, ...]
    duration_ms: float
