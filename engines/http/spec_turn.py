"""A speculative vLLM turn's bookkeeping (``engines.http.vllm``, "Speculation"): what it has emitted, and the stop
ids, EOS and ``max_tokens`` applied to every token (accepted draft tokens are prompt tokens to vLLM, so its own stop
checks never see them)."""

from __future__ import annotations

import dataclasses

from core.types import Drafter, FinishReason, Origin, TokenChunk


@dataclasses.dataclass(slots=True)
class SpecTurn:
    """What a speculative turn has emitted; stop ids, EOS and ``max_tokens`` are applied here to every token
    (accepted draft tokens are prompt tokens to vLLM, so its own stop checks never see them)."""

    history: list[int]
    stops: frozenset[int]
    max_tokens: int
    version: int
    produced: int = 0
    finish: FinishReason | None = None
    tail: TokenChunk | None = None  # the tokens that came with the finish

    def budget(self) -> int:
        """Longest useful draft: the last token of the turn is always the model's."""
        return self.max_tokens - self.produced - 1

    def draft(self, drafter: Drafter) -> tuple[int, ...]:
        return tuple(drafter.draft(self.history, self.budget()))[: max(self.budget(), 0)]

    def empty(self) -> TokenChunk:
        return TokenChunk((), (), self.version)

    def take(
        self, ids: list[int], logprobs: list[float], origins: list[Origin], engine_finish: FinishReason | None
    ) -> TokenChunk:
        """Append emitted tokens up to a stop id or ``max_tokens``; return a chunk of those kept."""
        kept = 0
        for tok in ids:
            kept += 1
            self.history.append(tok)
            self.produced += 1
            if tok in self.stops:
                self.finish = FinishReason.STOP
            elif self.produced >= self.max_tokens:
                self.finish = FinishReason.LENGTH
            if self.finish is not None:
                break
        if self.finish is None and engine_finish is not None and kept == len(ids):
            self.finish = engine_finish  # a stop vLLM applies that this adapter does not know of
        shown = tuple(origins[:kept]) if any(o != Origin.SAMPLED for o in origins[:kept]) else ()
        chunk = TokenChunk(tuple(ids[:kept]), tuple(logprobs[:kept]), self.version, shown)
        if self.finish is not None:
            self.tail = chunk
        return chunk
