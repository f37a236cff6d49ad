"""Plain typed objects that cross the engine boundary (no protobuf here).

Invariant: token ids are the unit of exchange. Engines get ids and return ids with the
logprob of each sampled token under the distribution it was actually sampled from.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any, Protocol, get_type_hints, runtime_checkable

from pydantic import ConfigDict, Field

from core.errors import InvalidArgument, TokenOutOfVocabulary, Unimplemented


class Origin(enum.IntEnum):
    """Where a token came from; values equal ``primerl.v1.TokenOrigin``."""

    PROMPT = 1
    ENV = 2
    SAMPLED = 3
    DRAFT_ACCEPTED = 4
    RESAMPLED = 5
    FORCED = 6

    @property
    def policy_sampled(self) -> bool:
        """True for tokens distributed as the policy (these get loss mask 1)."""
        return self in (Origin.SAMPLED, Origin.DRAFT_ACCEPTED, Origin.RESAMPLED)


class FinishReason(enum.IntEnum):
    """Why a turn ended; values equal ``primerl.v1.FinishReason``."""

    STOP = 1
    LENGTH = 2
    ABORT = 3


class Capability(enum.Enum):
    """Something an engine may or may not do; declared in ``EngineInfo.capabilities``.

    A request that needs a capability its engine lacks is refused (``check_capabilities``), never
    silently served without it.
    """

    RAW_LOGPROBS = "raw_logprobs"  # also report logprobs under the raw (temperature-1) distribution
    KEPT_MASS = "kept_mass"  # also report the log of the probability mass the sampler's filters kept
    MIN_P = "min_p"  # min-p filtering
    CONSTRAINTS = "constraints"  # honours GenerateRequest.constraint (grammar-masked decoding)
    DRAFT_VERIFY = "draft_verify"  # verifies GenerateRequest.drafter's drafts exactly
    WEIGHT_UPDATES = "weight_updates"  # loads new weights (update_weights)
    SCORE = "score"  # scores given tokens by teacher forcing (``engines.scoring``: ``score(request)``)
    # Computes a GRPO group's shared prompt once even when its members arrive together; to an engine without it
    # (vLLM: requests scheduled in one step each prefill the prompt) the bridge sends a group's first member
    # ahead and the others once its prompt is prefilled (``server.turns``), so they hit its prefix cache.
    GROUP_PREFILL = "group_prefill"
    # Loads weights from a safetensors directory the bridge can read too: an update's checkpoint is checked against
    # ``EngineInfo.base_weights`` (``engines.checkpoint``) before any bridge pauses (the prepare phase).
    LOCAL_CHECKPOINTS = "local_checkpoints"
    # Serves LoRA adapters loaded at run time, several at once, each request naming one (``GenerateRequest.adapter``):
    # ``load_adapter(ref, path)`` / ``unload_adapter(ref)``.
    LORA = "lora"


@dataclass(frozen=True, slots=True)
class Needs:
    """``Annotated`` marker on a ``SamplingParams`` field: a value other than the default needs ``capability``."""

    capability: Capability


MIN_TEMPERATURE = 1e-5  # the smallest temperature > 0 sampled with (vLLM samples greedily below it)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters, the one type from the trainer client to the engine.

    Resolved (every field has its value) wherever an engine sees it; ``SamplingOverrides`` is the partial
    form a request carries, and ``merge`` layers them: server defaults < episode < step. The field
    annotations carry the bounds and docs of the server's ``[sampling]`` config section (pydantic reads
    them) and, with ``Needs``, the engine capability a non-default value requires. Adding a field: the
    proto message ``SamplingParams`` (same name), this class (+ ``validate``), and the engines that
    implement it; ``tests/unit/test_proto_mirrors.py`` checks that the proto and this class agree.

    ``temperature == 0`` is greedy decoding; its reported logprobs are those of the raw
    (temperature-1) distribution, since the sampling distribution is a point mass.
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    temperature: Annotated[float, Field(ge=0, description="Softmax temperature; 0 is greedy.")] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, description="Nucleus mass; 1 disables it.")] = 1.0
    top_k: Annotated[int, Field(ge=0, description="Top-k cut; 0 disables it.")] = 0
    min_p: Annotated[
        float,
        Field(ge=0, le=1, description="Keep tokens with p >= min_p * p_max (after temperature); 0 disables it."),
        Needs(Capability.MIN_P),
    ] = 0.0
    max_tokens: Annotated[int, Field(ge=1, description="Tokens sampled per turn at most.")] = 256
    stop_token_ids: Annotated[
        tuple[int, ...], Field(description="Token ids that end a turn (besides the model's end-of-turn tokens).")
    ] = ()
    seed: Annotated[int | None, Field(ge=0, lt=2**63, description="Seed; none = random.")] = None
    ignore_eos: Annotated[bool, Field(description="Stop only on stop_token_ids or max_tokens.")] = False
    raw_logprobs: Annotated[
        bool,
        Field(description="Also report logprobs under the raw (temperature-1) distribution."),
        Needs(Capability.RAW_LOGPROBS),
    ] = False
    kept_mass: Annotated[
        bool,
        Field(
            description="Also report, per sampled token, the log of the probability mass (after temperature) the "
            "sampler kept: top-k, top-p, min-p and a grammar mask; 0 when nothing was cut. logprob + kept_logmass is "
            "the token's logprob under the untruncated temperature-scaled distribution."
        ),
        Needs(Capability.KEPT_MASS),
    ] = False

    def merge(self, overrides: SamplingOverrides) -> SamplingParams:
        """These parameters with the fields ``overrides`` sets on top (``defaults.merge(episode)``...)."""
        return replace(self, **overrides) if overrides else self  # most Steps override nothing

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidArgument(
                f"sampling.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}: "
                "logits divided by it overflow; send 0 for greedy decoding"
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"sampling.min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"sampling.seed must be in [0, 2**63), got {self.seed}")
        check_token_ids(self.stop_token_ids, vocab_size, "sampling.stop_token_ids")


SAMPLING_FIELDS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams)}
"""Every ``SamplingParams`` field with its default, in declaration order."""
_NEEDS: tuple[tuple[str, Any, Capability], ...] = tuple(
    (name, SAMPLING_FIELDS[name], m.capability)
    for name, hint in get_type_hints(SamplingParams, include_extras=True).items()
    for m in getattr(hint, "__metadata__", ())
    if isinstance(m, Needs)
)


class SamplingOverrides(Mapping[str, Any]):
    """The ``SamplingParams`` fields a request sets (the rest inherit): ``SamplingOverrides(temperature=0.7)``.

    Keys are ``SamplingParams`` field names (anything else is a TypeError naming the known ones); a None
    value, or an empty ``stop_token_ids``, means "not set". Immutable and hashable.
    """

    __slots__ = ("_set",)
    _set: dict[str, Any]

    def __init__(self, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        given = {**values, **kwargs} if values else kwargs
        unknown = sorted(k for k in given if k not in SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling field(s) {unknown}; the fields are {list(SAMPLING_FIELDS)}")
        normalised: dict[str, Any] = {}
        for k, v in given.items():
            if isinstance(SAMPLING_FIELDS[k], tuple):  # a list field (a proto repeated field): empty = not set
                v = tuple(v) if v else None
            if v is not None:
                normalised[k] = v
        object.__setattr__(self, "_set", normalised)

    def __getitem__(self, key: str) -> Any:
        return self._set[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._set)

    def __len__(self) -> int:
        return len(self._set)

    def __getattr__(self, name: str) -> Any:
        """``overrides.seed``: the value set, or None when it is inherited."""
        if name in SAMPLING_FIELDS:
            return self._set.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SamplingOverrides is immutable")

    def __hash__(self) -> int:
        return hash(frozenset(self._set.items()))

    def __repr__(self) -> str:
        return f"SamplingOverrides({', '.join(f'{k}={v!r}' for k, v in self._set.items())})"


NO_OVERRIDES = SamplingOverrides()


def check_token_ids(ids: tuple[int, ...] | list[int], vocab_size: int, what: str) -> None:
    """Raise TokenOutOfVocabulary naming the first id outside ``[0, vocab_size)``."""
    for i, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise TokenOutOfVocabulary(f"{what}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")


@runtime_checkable
class Drafter(Protocol):
    """Proposes deterministic draft tokens for speculative decoding (``speculation/``).

    The engine calls ``draft`` with the whole token history (prompt and everything emitted so
    far) before a verify step and ``feedback`` after it. A draft never changes *what* is
    sampled, only how many tokens one target forward yields (``engines.sampling.verify``).
    """

    def draft(self, history: Sequence[int], max_len: int) -> tuple[int, ...]: ...

    def feedback(self, drafted: int, accepted: int) -> None: ...


@runtime_checkable
class Constraint(Protocol):
    """Grammar mask for constrained decoding (opt-in; changes the sampling distribution).

    ``allowed(history)`` returns the token ids allowed next, or None where the position is
    unconstrained. A position with exactly one allowed token is *forced* (origin FORCED).
    """

    def allowed(self, history: Sequence[int]) -> Sequence[int] | None: ...


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One turn of generation: continue ``token_ids`` (the episode's whole history).

    ``episode_id`` and ``group_id`` let stateful engines keep and share KV across turns;
    stateless engines ignore them. ``cache_salt`` separates KV of different weights.
    ``drafter`` (optional) turns on exact speculative decoding on engines that can verify;
    others ignore it and decode plainly. ``constraint`` (optional) masks the policy.
    """

    request_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    episode_id: str = ""
    group_id: str = ""
    cache_salt: str = ""
    drafter: Drafter | None = field(default=None, compare=False)
    adapter: AdapterRef | None = None  # sample with this LoRA adapter version (``Capability.LORA``); None: the base
    constraint: Constraint | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens produced since the previous chunk. The last chunk has ``finish_reason`` set."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    origins: tuple[Origin, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    raw_logprobs: tuple[float, ...] = ()  # when asked: logprob of each token at temperature 1, unfiltered
    kept_logmass: tuple[float, ...] = ()  # when asked: log of the mass the filters kept (sampling.kept_mass)

    def origins_or_sampled(self) -> tuple[Origin, ...]:
        return self.origins or (Origin.SAMPLED,) * len(self.token_ids)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the bridge needs to know about a running engine."""

    engine: str
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    replica: str = "local"
    # What the engine can do (``Capability``); a request needing anything else is refused by
    # ``check_capabilities`` instead of being served without it.
    capabilities: frozenset[Capability] = frozenset()
    # The checkpoint the engine started from, as ``WeightUpdate.checkpoint_path`` takes it ("" = unknown: the
    # bridge cannot take it back to its base weights).
    base_weights: str = ""
    # The engine's KV-event publisher (ZMQ, e.g. ``tcp://127.0.0.1:5557``) and its replay endpoint; "" = the
    # engine publishes none, and the prefix index learns this replica's cache from routed turns.
    kv_events: str = ""
    kv_events_replay: str = ""

    @property
    def supports_weight_updates(self) -> bool:
        return Capability.WEIGHT_UPDATES in self.capabilities

    @property
    def supports_constraints(self) -> bool:
        """Honours ``GenerateRequest.constraint``; others would decode unconstrained (the bridge refuses)."""
        return Capability.CONSTRAINTS in self.capabilities


def check_capabilities(info: EngineInfo, params: SamplingParams) -> None:
    """Raise Unimplemented naming the engine and the capability when ``params`` needs one ``info`` lacks.

    A field needs the capability of its ``Needs`` marker when its value is not the default (``min_p > 0``,
    ``raw_logprobs``), so a request that does not use a feature never depends on it.
    """
    for name, default, capability in _NEEDS:
        if capability not in info.capabilities and getattr(params, name) != default:
            raise Unimplemented(
                f"engine {info.engine!r} (replica {info.replica}) does not support sampling.{name} "
                f"(capability {capability.value!r}); leave it unset or use an engine that has it"
            )


@dataclass(frozen=True, slots=True)
class EngineHealth:
    healthy: bool
    detail: str = ""


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One version of a LoRA adapter as the replicas load it: ``served`` is the name the engine knows it by, one per
    version, so a new version loads beside the old one and the old one serves until the new one is proven."""

    name: str
    version: int

    @property
    def served(self) -> str:
        return f"{self.name}@v{self.version}"


def check_adapter_name(name: str) -> str:
    """InvalidArgument unless ``name`` can name an adapter (it becomes part of engine model names and cache salts)."""
    if not ADAPTER_NAME.fullmatch(name):
        raise InvalidArgument(
            f"adapter name {name!r} is not valid: 1-64 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """Load the weights in ``checkpoint_path`` as ``policy_version``; ``restore``: a rollback to the weights the
    replica served before the update in progress (an engine that kept them, vLLM's staged twin, swaps them back)."""

    checkpoint_path: str
    policy_version: int
    keep_kv: bool = False
    restore: bool = False


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message to render with the model's chat template."""

    role: str
    content: str
    name: str = ""


# The bridge's episode results as the trainer sees them: ``server`` builds them from its bridge, ``rl_client``
# from protobuf, and both hand back these same types (``rl_client.Started`` / ``server.calls.StartResult``,
# ``rl_client.EnvStatus`` / ``server.envsession.EnvOutcome``).


@dataclass(frozen=True, slots=True)
class Started:
    """Result of starting an episode: one id per group member."""

    episode_ids: list[str]
    group_id: str
    policy_version: int
    engine: str
    replica: str
    prompt_tokens: int
    env_task_id: str = ""  # the environment's task, for episodes started with ``env``

    @property
    def episode_id(self) -> str:
        return self.episode_ids[0]


@dataclass(frozen=True, slots=True)
class EnvStatus:
    """Where an episode's server-side tool loop stands after a Step (episodes started with ``env``;
    ``TurnDone.env`` on the wire)."""

    done: bool  # the environment graded the episode; end it
    reward: float | None  # the grader's reward, once done
    reason: str  # final_answer, max_tool_calls, context_exhausted, max_turns, env_error, aborted
    tool_calls: int  # executed in the episode so far
    turns: int  # model turns run by this Step
    truncated: bool = False
    error: str = ""


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters an engine exposes (for tests, metrics and benchmarks)."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0
    requests: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the bridge must know about the served model before the engine answers."""

    model_dir: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
