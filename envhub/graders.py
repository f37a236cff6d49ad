"""Graders: the one reward system of the env hub and of ``grpo``.

A ``Grader[S]`` is a named, deterministic score of one sample ``S`` (no randomness, no I/O, no model;
it never raises for anything a model wrote). What ``S`` is depends on who grades:

- ``Answer`` (final answer text and the task's reference): the answer graders, registered by name
  (``register_grader`` / ``get_grader``; ``exact`` is built in) so an environment, an eval or a verifier
  service picks one by id; ``constant`` (the sample's ``params["value"]``) is built in for smoke runs;
- ``envhub.rewards.RewardContext`` (grader score, format, steps, tool time, trace): the env shaping terms;
- ``grpo.rater.Rollout`` (turn texts, tool results, expected answer): the GRPO reward functions.

A ``Rubric[S]`` combines weighted graders into one reward with a per-term breakdown: a weighted sum
(``mean=False``, the env shaping) or mean (``mean=True``, the GRPO rater), optionally clipped, and across a
GRPO group per ``mode``: ``absolute`` (each member's own total), ``group_relative`` (min-max to [0, 1] inside
the group) or ``pareto`` (1.0 for the non-dominated front down to 0.0 for the last). A rubric is itself a
grader, so rubrics nest and register like any other.

Every grader declares the sandbox policy its code runs under: a ``sandbox_policy`` attribute naming a
shipped policy (``sandbox.policies``) or holding a ``SandboxPolicy``, ``grader`` when absent. The verifier
signs that policy's digest into each verdict; ``register_grader`` refuses a grader whose policy does not load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from core.errors import InvalidArgument
from sandbox.policies import DEFAULT_GRADER_POLICY, SandboxPolicy, policy_digest

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)
Mode = Literal["absolute", "group_relative", "pareto"]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


class Grader(Protocol[S_contra]):
    """A named, deterministic score of one sample."""

    @property
    def name(self) -> str: ...

    def __call__(self, sample: S_contra, /) -> float: ...


@dataclass(frozen=True, slots=True)
class FnGrader(Generic[S]):
    """A plain function under a name (``version`` and the ``sandbox_policy``'s digest go into signed verdicts:
    bump the version when scores change)."""

    name: str
    fn: Callable[[S], float]
    version: str = "1"
    sandbox_policy: str | SandboxPolicy = DEFAULT_GRADER_POLICY
    # A built-in grader whose cost is tiny and bounded (constant, exact): the verifier calls it inline
    # instead of handing it to a grader thread. Never set it for user code.
    inline: bool = False

    def __call__(self, sample: S, /) -> float:
        return float(self.fn(sample))


@dataclass(frozen=True, slots=True)
class Scored:
    """A rubric's total and each grader's (unweighted) value, in rubric order."""

    total: float
    terms: tuple[tuple[str, float], ...]


def pareto_fronts(points: Sequence[Sequence[float]]) -> list[int]:
    """Non-dominated sorting: front index per point (0 = not dominated by anyone)."""
    n = len(points)
    front = [-1] * n
    remaining = set(range(n))
    level = 0

    def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
        return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))

    while remaining:
        current = {i for i in remaining if not any(dominates(points[j], points[i]) for j in remaining if j != i)}
        for i in current:
            front[i] = level
        remaining -= current
        level += 1
    return front


class Rubric(Generic[S]):
    """Weighted graders combined into one reward; ``rate_group`` applies ``mode`` across a GRPO group."""

    sandbox_policy: str | SandboxPolicy = DEFAULT_GRADER_POLICY

    def __init__(
        self,
        graders: Iterable[Grader[S] | tuple[Grader[S], float]],
        *,
        mean: bool = False,
        clip: tuple[float, float] | None = None,
        mode: Mode = "absolute",
        name: str = "rubric",
    ) -> None:
        self.graders = tuple(g if isinstance(g, tuple) else (g, 1.0) for g in graders)
        if not self.graders:
            raise ValueError("a Rubric needs at least one grader")
        self.mean = mean
        self.clip = clip
        self.mode = mode
        self.name = name
        total = sum(w for _, w in self.graders)
        self._norm = total if mean and total > 0 else 1.0

    @classmethod
    def weighted(cls, fns: Mapping[str, tuple[Callable[[S], float], float]], mode: Mode = "absolute") -> Rubric[S]:
        """The weighted mean of named functions (in [0, 1] when every function is)."""
        return cls([(FnGrader(n, fn), w) for n, (fn, w) in fns.items()], mean=True, mode=mode)

    def components(self, sample: S) -> dict[str, float]:
        return {g.name: float(g(sample)) for g, _ in self.graders}

    def score(self, sample: S) -> Scored:
        """The total (weighted sum or mean, clipped) and the per-grader values."""
        values = tuple((g.name, float(g(sample))) for g, _ in self.graders)
        total = sum(v * w for (_, v), (_, w) in zip(values, self.graders, strict=True)) / self._norm
        if self.clip is not None:
            total = min(self.clip[1], max(self.clip[0], total))
        return Scored(total=total, terms=values)

    def absolute(self, sample: S) -> float:
        return self.score(sample).total

    __call__ = absolute

    def rate_group(self, group: Sequence[S]) -> list[float]:
        if self.mode == "absolute":
            return [self.absolute(s) for s in group]
        if self.mode == "group_relative":
            raw = [self.absolute(s) for s in group]
            lo, hi = min(raw), max(raw)
            return [0.0 if hi == lo else (x - lo) / (hi - lo) for x in raw]
        comps = [self.components(s) for s in group]
        fronts = pareto_fronts([list(c.values()) for c in comps])
        worst = max(fronts)
        return [1.0 if worst == 0 else 1.0 - f / worst for f in fronts]


# -- answer graders ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """What an answer grader sees: the model's final answer and the task's reference."""

    text: str
    reference: str


def normalize(text: str) -> str:
    """Lower case, collapsed whitespace, no surrounding quotes or trailing punctuation."""
    text = " ".join(text.lower().split())
    return text.strip(" \"'`").rstrip(".!;:").strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def grade_exact(answer: str, reference: str) -> float:
    """1.0 for the reference (numbers compared by value, 1e-6 relative), 0.5 when the answer
    contains it as a whole word/number among other text, 0.0 otherwise."""
    a, r = normalize(answer), normalize(reference)
    if not a:
        return 0.0
    if a == r:
        return 1.0
    ref_num = _number(r)
    if ref_num is not None:
        ans_num = _number(a)
        if ans_num is not None and abs(ans_num - ref_num) <= 1e-6 * max(1.0, abs(ref_num)):
            return 1.0
        found = [_number(m) for m in _NUMBER.findall(a)]
        if any(x is not None and abs(x - ref_num) <= 1e-6 * max(1.0, abs(ref_num)) for x in found):
            return 0.5
        return 0.0
    if re.search(r"(?<![\w-])" + re.escape(r) + r"(?![\w-])", a):
        return 0.5
    return 0.0


EXACT: Grader[Answer] = FnGrader("exact", lambda a: grade_exact(a.text, a.reference), inline=True)


class WithParams(Protocol):
    """A sample that carries the caller's grader params (the verifier's ``VerdictSample``)."""

    @property
    def params(self) -> Mapping[str, Any]: ...


def grade_constant(sample: WithParams) -> float:
    """``params.value``, for tests and smoke runs of a scoring service."""
    value = sample.params.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"params.value: the constant grader needs a number, got {value!r}")
    return float(value)


CONSTANT: Grader[WithParams] = FnGrader("constant", grade_constant, inline=True)

_REGISTRY: dict[str, Grader[Any]] = {}


def grader_policy_digest(grader: Grader[Any]) -> str:
    """The digest of the sandbox policy ``grader`` declares (``grader`` when it declares none)."""
    return policy_digest(getattr(grader, "sandbox_policy", DEFAULT_GRADER_POLICY))


def register_grader(grader: Grader[Any]) -> None:
    """Register ``grader`` under its name (a name is registered once: ids stay stable); its declared
    sandbox policy must load."""
    if _REGISTRY.get(grader.name, grader) is not grader:
        raise InvalidArgument(f"a grader named {grader.name!r} is already registered")
    grader_policy_digest(grader)
    _REGISTRY[grader.name] = grader


def get_grader(name: str) -> Grader[Any]:
    """The grader registered as ``name``."""
    grader = _REGISTRY.get(name)
    if grader is None:
        raise InvalidArgument(f"unknown grader {name!r}; registered: {', '.join(grader_names())}")
    return grader


def grader_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


register_grader(EXACT)
register_grader(CONSTANT)
