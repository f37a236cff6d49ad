"""Constrained mode (opt-in): decode tool-call spans under the grammar mask.

The span opens as in draft-only mode (``SpanTracker``), but the mask applies only once the model has
written the whole begin tag itself (``<tool_call>``): forcing a tag the policy did not choose would put
every ``<`` on a tool-call path. From there to the end of the block, ``allowed`` returns the matcher's
token mask and the engine (only ``embedded``: ``EngineInfo.supports_constraints``) samples from the
masked, renormalised distribution p~ = p * mask / Z:

* a position with a single allowed token is emitted as origin FORCED: no choice was made, so (DESIGN
  invariant 2) its logprob is NaN and its loss mask 0 (``Origin.policy_sampled`` is False);
* a masked position with several allowed tokens is origin SAMPLED, and its logprob is log p~(x), the
  logprob under the masked distribution it was drawn from, NOT log p(x) of the policy (ask for
  ``raw_logprobs`` to also get the raw temperature-1 policy logprob).

This changes the sampling distribution (spec A1, mode 1). The replay handle: ``steps`` records, per
generated position (an index into the episode's token ids), how many tokens the mask allowed; the bridge
merges it into the trajectory metadata under ``speculation.factory.MASKED_POSITIONS_KEY`` as a JSON object
``{"position": allowed_count}``. ``replay_masks`` rebuilds the exact masks from the token ids and the
tool schemas, so a trainer can renormalise its own logprobs over the same mask, or drop masked positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speculation.drafters import DraftStats, SpanTracker
from speculation.grammar import CompiledToolGrammar


class GrammarConstraint:
    """``core.types.Constraint`` over one generation request (state is per request)."""

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


def replay_masks(compiled: CompiledToolGrammar, token_ids: Sequence[int], start: int, end: int) -> dict[int, list[int]]:
    """The allowed-token lists of the masked positions of one turn (generated tokens ``[start, end)``).

    Deterministic in the token ids: equals what ``GrammarConstraint.allowed`` returned while decoding.
    """
    constraint = GrammarConstraint(compiled)
    masks: dict[int, list[int]] = {}
    for pos in range(start, end):
        allowed = constraint.allowed(token_ids[:pos])
        if allowed is not None:
            masks[pos] = list(allowed)
    return masks
