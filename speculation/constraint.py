"""Constrained mode (opt-in): decode tool-call spans under the grammar mask.

The span opens as in draft-only mode (``SpanTracker``), but the mask applies only once the model has
written the whole begin tag itself (``<tool_call>``): forcing a tag the policy did not choose would put
every ``<`` on a tool-call path. From there to the end of the block, ``allowed`` returns the matcher's
token mask; the engine samples from the masked, renormalised distribution p~ and emits a position with
a single allowed token as origin FORCED (p~ = 1, logprob 0).

This changes the sampling distribution (spec A1, mode 1): a trainer must replay the masks (``steps``
records, per generated position, whether it was masked and how many tokens were allowed) or drop
FORCED tokens from the loss (``Origin.policy_sampled`` is False for them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speculation.drafters import DraftStats, SpanTracker
from speculation.grammar import CompiledToolGrammar


class GrammarConstraint:
    """``engines.types.Constraint`` over one generation request (state is per request)."""

    def __init__(self, compiled: CompiledToolGrammar) -> None:
        self.compiled = compiled
        self.stats = DraftStats()
        self.tracker = SpanTracker(compiled, self.stats)
        self.steps: dict[int, int] = {}  # generated position -> allowed-token count (masked positions only)

    def _tag_written(self, history: Sequence[int]) -> bool:
        span = list(history[self.tracker.span_start :])
        return self.compiled.grammar.begin in self.compiled.tokenizer.decode_str(span)

    def allowed(self, history: Sequence[int]) -> Sequence[int] | None:
        self.tracker.sync(history)
        matcher = self.tracker.matcher
        if matcher is None or not self._tag_written(history):
            return None
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        ids = np.flatnonzero(bits[: self.compiled.tokenizer.vocab_size])
        self.steps[len(history)] = int(ids.size)
        return ids.tolist()
