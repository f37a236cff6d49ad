"""Plain typed objects that cross the engine boundary (no protobuf here).

Invariant: token ids are the unit of exchange. Engines get ids and return ids with the
logprob of each sampled token under the distribution it was actually sampled from.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engines.errors import InvalidArgument, TokenOutOfVocabulary


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


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Fully resolved sampling parameters of one engine call.

    ``temperature == 0`` is greedy decoding; its reported logprobs are those of the raw
    (temperature-1) distribution, since the sampling distribution is a point mass.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    raw_logprobs: bool = False  # also report logprobs under the raw (temperature-1) distribution

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"sampling.seed must be in [0, 2**63), got {self.seed}")
        check_token_ids(self.stop_token_ids, vocab_size, "sampling.stop_token_ids")


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
    supports_weight_updates: bool
    replica: str = "local"
    # Honours ``GenerateRequest.constraint`` (grammar-masked decoding). Engines that do not would silently
    # decode unconstrained, so the bridge refuses constrained speculation on them.
    supports_constraints: bool = False


@dataclass(frozen=True, slots=True)
class EngineHealth:
    healthy: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """Load the weights in ``checkpoint_path`` as ``policy_version``."""

    checkpoint_path: str
    policy_version: int
    keep_kv: bool = False


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message to render with the model's chat template."""

    role: str
    content: str
    name: str = ""


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
