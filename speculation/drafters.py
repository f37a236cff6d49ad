"""Drafters: deterministic draft tokens for exact speculative decoding (``engines.sampling.verify``).

Two sources, used in priority order inside a tool-call span and (optionally) outside one:

* **grammar**: the llguidance matcher's fast-forward tokens (``compute_ff_tokens``): bytes the
  grammar forces (``{"name": "``, keys, ``name`` constants when only one tool fits, the closing
  tag), tokenised canonically by the matcher, so every draft is grammar-valid;
* **ngram** (prompt lookup): the continuation of the most recent earlier occurrence of the
  history's last n tokens (n from ``max_ngram`` down to ``min_ngram``): tool arguments often copy
  text from the prompt or earlier observations. Inside a span the draft is cut to the prefix the
  matcher validates (``validate_tokens``).

Span tracking: the drafter follows the history it is shown. A span opens at a generated token
whose text starts (after whitespace) with ``<`` and that the grammar accepts as the start of a
block; it closes when the matcher stops (block complete) or rejects a token (the policy is not
constrained in draft-only mode and may leave the grammar; then the span is abandoned).

Adaptive length and gate: n-gram drafts grow while fully accepted and shrink to one past the
accepted prefix after a rejection. Outside spans, drafting stops when the moving acceptance rate
falls below ``gate_min_acceptance`` and resumes when the next tool-call span opens.

Invariant: a drafter only proposes; it never changes which tokens are emitted, so any bug here
costs speed, not correctness. One drafter serves one generation request (its history only grows).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance

from speculation.config import SpeculationConfig
from speculation.grammar import CompiledToolGrammar


class NgramIndex:
    """Incremental map from each n-gram of a growing history to the end of its latest occurrence."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        self.min_n, self.max_n = min_n, max(min_n, max_n)
        self._maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._next_end = 1

    def lookup(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        length = len(history)
        if length < self._next_end:  # not the history this index was built on: start over
            self._maps = {n: {} for n in self._maps}
            self._next_end = 1
        # Index n-grams ending before the last position, so the suffix never finds itself.
        for end in range(self._next_end, length):
            for n, table in self._maps.items():
                if end >= n:
                    table[tuple(history[end - n : end])] = end
        self._next_end = max(self._next_end, length)
        if k <= 0:
            return ()
        for n in range(self.max_n, self.min_n - 1, -1):
            if length >= n:
                hit = self._maps[n].get(tuple(history[length - n :]))
                if hit is not None:
                    return tuple(history[hit : hit + k])
        return ()


@dataclass(slots=True)
class DraftStats:
    """What a drafter proposed and what was accepted, per source (for metrics and benchmarks)."""

    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    verify_steps: dict[str, int] = field(default_factory=dict)
    spans_opened: int = 0
    spans_completed: int = 0
    spans_abandoned: int = 0
    span_tokens: int = 0  # generated tokens consumed by the matcher inside spans
    span_steps: int = 0  # target steps (one forward each) taken while a span was open

    def add(self, source: str, drafted: int, accepted: int) -> None:
        self.drafted[source] = self.drafted.get(source, 0) + drafted
        self.accepted[source] = self.accepted.get(source, 0) + accepted
        self.verify_steps[source] = self.verify_steps.get(source, 0) + 1


class SpanTracker:
    """Follows a growing token history and keeps a matcher on the open tool-call span, if any."""

    def __init__(self, compiled: CompiledToolGrammar, stats: DraftStats) -> None:
        self.compiled = compiled
        self.stats = stats
        self.matcher: llguidance.LLMatcher | None = None
        self.span_start = -1
        self._start: int | None = None  # first generated position (spans open only after it)
        self._seen = 0
        self._opens: dict[int, bool] = {}

    def _may_open(self, token: int) -> bool:
        hit = self._opens.get(token)
        if hit is None:
            hit = self.compiled.tokenizer.decode_str([token]).lstrip().startswith("<")
            self._opens[token] = hit
        return hit

    def sync(self, history: Sequence[int]) -> None:
        if self._start is None:
            self._start = self._seen = len(history)
        for pos in range(self._seen, len(history)):
            token = history[pos]
            if self.matcher is not None:
                if not self.matcher.consume_token(token):
                    self.matcher = None
                    self.stats.spans_abandoned += 1
                    continue
                self.stats.span_tokens += 1
                if self.matcher.is_stopped():
                    self.matcher = None
                    self.stats.spans_completed += 1
            elif self._may_open(token):
                m = self.compiled.matcher()
                if m.consume_token(token):
                    self.matcher, self.span_start = m, pos
                    self.stats.spans_opened += 1
                    self.stats.span_tokens += 1
        self._seen = len(history)

    @property
    def in_span(self) -> bool:
        return self.matcher is not None


class SpeculativeDrafter:
    """Grammar + n-gram drafter with adaptive length and an acceptance gate (see module docstring)."""

    def __init__(self, config: SpeculationConfig, compiled: CompiledToolGrammar | None = None) -> None:
        self.config = config
        self.stats = DraftStats()
        self.tracker = SpanTracker(compiled, self.stats) if compiled is not None else None
        self.use_grammar = "grammar" in config.drafters
        use_ngram = "ngram" in config.drafters
        self.ngram = NgramIndex(config.min_ngram, config.max_ngram) if use_ngram else None
        self._k = config.max_draft_tokens
        self._source = ""
        self._outside: deque[int] = deque(maxlen=config.gate_window)  # 1 = accepted draft token outside spans
        self.gate_open = True

    def draft(self, history: Sequence[int], max_len: int) -> tuple[int, ...]:
        limit = min(max_len, self.config.max_draft_tokens)
        self._source = ""
        if self.tracker is not None:
            was_in_span = self.tracker.in_span
            self.tracker.sync(history)
            if self.tracker.in_span and not was_in_span:
                self.gate_open = True  # a tool-call span starts: speculation is worth trying again
                self._outside.clear()
        if limit <= 0:
            if self.ngram is not None:
                self.ngram.lookup(history, 0)  # keep the index in step
            return ()
        matcher = self.tracker.matcher if self.tracker is not None else None
        if matcher is not None:
            self.stats.span_steps += 1
            forced = matcher.compute_ff_tokens() if self.use_grammar else []
            if forced:
                self._source = "grammar"
                if self.ngram is not None:
                    self.ngram.lookup(history, 0)
                return tuple(forced[:limit])
            if self.ngram is None:
                return ()
            draft = self.ngram.lookup(history, min(limit, self._k))
            draft = draft[: matcher.validate_tokens(list(draft))] if draft else ()
            self._source = "ngram_span"
            return draft
        if self.ngram is None:
            return ()
        draft = self.ngram.lookup(history, min(limit, self._k) if self.gate_open else 0)
        self._source = "ngram"
        return draft

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        source = self._source or "ngram"
        self.stats.add(source, drafted, accepted)
        if source != "grammar":
            # Adaptive length: grow while fully accepted, else one past what was accepted.
            mx = self.config.max_draft_tokens
            self._k = min(mx, self._k + 2) if accepted == drafted else max(1, accepted + 1)
        if source == "ngram":
            self._outside.extend([1] * accepted + [0] * (drafted - accepted))
            seen = len(self._outside)
            low = sum(self._outside) / seen < self.config.gate_min_acceptance
            if low and seen >= max(1, self.config.gate_min_samples):
                self.gate_open = False


def build_drafter(config: SpeculationConfig, compiled: CompiledToolGrammar | None) -> SpeculativeDrafter:
    """The drafter of one generation request (state is per request: build one per turn)."""
    return SpeculativeDrafter(config, compiled)
