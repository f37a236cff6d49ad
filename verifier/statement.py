"""What a verdict signs: the trajectory's canonical encoding, its SHA-256 subject, the in-toto Statement v1.

Canonical trajectory encoding (``primerl.trajectory.v1``), all integers big-endian::

    b"primerl.trajectory.v1\\n"
    u32 len(episode_id) || episode_id (UTF-8)
    u32 n (tokens)
    n x i64 token_ids
    n x f64 logprobs    (IEEE-754 binary64; every NaN encoded as 0x7ff8000000000000)
    n x u8  loss_mask   (0 or 1)
    n x u8  origins     (core.types.Origin values: prompt 1 .. forced 6)
    n x i64 policy_versions

One trajectory has exactly one encoding (no field order, whitespace or float formatting to vary), so
the subject digest is a function of the tokens alone. The Statement and envelope are canonical JSON
(``core.canonical``: sorted keys, no whitespace, UTF-8, no NaN): the same verdict of the same input signs the same bytes
except ``predicate.timings`` (when and how long the grader ran), the one part that varies by design.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from core.types import Origin

ENCODING = "primerl.trajectory.v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://primerl-servekit.dev/attestation/verdict/v1"
_ORIGIN_NAMES = {o.name.lower(): int(o) for o in Origin}


_ORIGIN_VALUES = frozenset(_ORIGIN_NAMES.values())
_NAN = math.nan  # packs as the canonical quiet NaN, whatever payload the NaN it replaces had


def _origin(value: Any) -> int:
    if type(value) is int and value in _ORIGIN_VALUES:  # the common case, first
        return value
    if isinstance(value, str):
        if value.lower() not in _ORIGIN_NAMES:
            raise ValueError(f"unknown origin {value!r}; one of {', '.join(_ORIGIN_NAMES)}")
        return _ORIGIN_NAMES[value.lower()]
    if isinstance(value, bool) or not isinstance(value, int) or value not in _ORIGIN_NAMES.values():
        raise ValueError(f"unknown origin {value}; one of {sorted(_ORIGIN_NAMES.values())}")
    return int(value)


class Trajectory(BaseModel):
    """An episode's exact token record (``EndEpisode``'s arrays); one entry per token in every list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episode_id: str = Field(min_length=1, max_length=256, description="The bridge's episode id.")
    token_ids: list[Annotated[int, Field(ge=0, lt=2**63)]] = Field(description="Every token id, in order.")
    logprobs: list[float | None] = Field(description="Logprob per token; null (or NaN) where not sampled.")
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] = Field(description="1 for policy-sampled tokens, else 0.")
    origins: list[Annotated[int, BeforeValidator(_origin)]] = Field(
        description="Origin per token: 1..6 or prompt|env|sampled|draft_accepted|resampled|forced."
    )
    policy_versions: list[Annotated[int, Field(ge=-(2**63), lt=2**63)]] = Field(description="Version per token.")

    @model_validator(mode="after")
    def _same_length(self) -> Trajectory:
        n = len(self.token_ids)
        for name in ("logprobs", "loss_mask", "origins", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} token_ids")
        return self

    def encode(self) -> bytes:
        """The canonical encoding (module docstring)."""
        n = len(self.token_ids)
        eid = self.episode_id.encode()
        lps = struct.pack(f">{n}d", *[_NAN if lp is None or lp != lp else lp for lp in self.logprobs])
        return b"".join(
            (
                ENCODING.encode() + b"\n",
                struct.pack(">I", len(eid)),
                eid,
                struct.pack(">I", n),
                struct.pack(f">{n}q", *self.token_ids),
                lps,
                bytes(self.loss_mask),
                bytes(self.origins),
                struct.pack(f">{n}q", *self.policy_versions),
            )
        )

    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @property
    def policy_version(self) -> int:
        """The newest policy version among the tokens (0 for an empty trajectory)."""
        return max(self.policy_versions, default=0)


@dataclass(frozen=True, slots=True)
class VerdictSample:
    """What a grader sees in the verifier: the trajectory and the request's params.

    ``text`` / ``reference`` (``params.answer`` / ``params.reference``) make it an ``Answer`` for the answer
    graders (``exact``); ``params`` is what ``constant`` reads.
    """

    trajectory: Trajectory
    params: Mapping[str, Any]

    @property
    def text(self) -> str:
        return str(self.params.get("answer", ""))

    @property
    def reference(self) -> str:
        return str(self.params.get("reference", ""))


@dataclass(frozen=True, slots=True)
class Verdict:
    """A graded trajectory, ready to sign (``statement()``)."""

    subject_digest: str
    episode_id: str
    grader: str
    grader_version: str
    reward: float
    params: Mapping[str, Any]
    policy_version: int
    started_at: str
    grade_seconds: float
    sandbox_policy_digest: str = ""

    def statement(self) -> dict[str, Any]:
        return {
            "_type": STATEMENT_TYPE,
            "subject": [{"name": f"trajectory:{self.episode_id}", "digest": {"sha256": self.subject_digest}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {
                "encoding": ENCODING,
                "grader": {"id": self.grader, "version": self.grader_version},
                "reward": self.reward,
                "params": dict(self.params),
                "policy_version": self.policy_version,
                "sandbox_policy_digest": self.sandbox_policy_digest,
                "timings": {"started_at": self.started_at, "grade_seconds": self.grade_seconds},
            },
        }
