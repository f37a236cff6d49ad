"""Stop strings matched as a choice streams, decoding only the tokens each update adds.

``StopScanner.scan`` finds what decoding every token on every update and searching the whole text finds (the
earliest match in the choice's text, a tie going to the smaller stop string, and its index in that text), with
work per update bounded by the update, not by the choice's length.

How (vLLM's incremental detokenizer, with a check):
- the scanner keeps ``read`` (the tokens whose text is committed) and ``prefix``: the latest commit at least
  ``CONTEXT`` tokens before ``read`` (or the start). An update decodes ``ids[prefix:read]`` and ``ids[prefix:]``;
  the new text is what the second adds to the first (the prefix gives the tokenizer its context: the space
  between two words, a space cleaned up before punctuation).
- the new text is committed (``read = len(ids)``) unless it ends in U+FFFD: a character split across tokens,
  which the next tokens complete and decode again. It is searched either way, as the whole text showed it.
  (After ``PENDING`` tokens it is committed all the same: no character spans that many, so the text is garbage;
  if a character it cut does complete later, the check below sees it.)
- the search covers the new text and the committed text's last ``longest stop - 1`` characters: a match ending
  earlier would have been found by an earlier update, and a match that straddles updates starts in that tail.
  Only the tail and the committed length are kept, never the whole text.
- a tokenizer whose text is not local to its tokens (``ids[prefix:]`` decodes to something that does not
  extend ``ids[prefix:read]``: a space cleaned up across the boundary, say) is caught by that check: that
  update decodes and searches the whole text, as before, and the scan goes on from there. What the check
  catches is a change inside the window: a tokenizer whose text changes more than ``CONTEXT`` tokens back is
  not one we know of.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engines.base import Tokenizer

SPLIT = "\ufffd"  # what a decoder shows for a character whose bytes have not all arrived
CONTEXT = 4  # tokens, at least, decoded before the new ones (a clean-up pattern such as " n't" spans up to 4)
PENDING = 16  # tokens whose text ends in a split character, at most, before it is committed all the same


class StopScanner:
    """The stop strings of one choice, over its growing token ids (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty, and there must be at least one")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.keep = max(map(len, self.stops)) - 1  # committed characters a straddling match can start in
        self.commits: deque[int] = deque([0])  # token offsets of commits, from ``prefix`` to ``read``
        self.length = 0  # characters committed (the text of ids[:read])
        self.tail = ""  # the last ``keep`` of them
        self.decoded = 0  # token ids decoded, all updates together (the work: bounded per update)

    def _decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids) if ids else ""

    def scan(self, ids: Sequence[int]) -> tuple[int, str] | None:
        """The first stop string in the text of ``ids`` (the choice's ids so far: the last call's, extended):
        ``(its index in the text, the stop string)``, or None."""
        prefix, read = self.commits[0], self.commits[-1]
        head = self._decode(ids[prefix:read])
        window = self._decode(ids[prefix:])
        local = window.startswith(head)
        if local:
            new = window[len(head) :]
            start, text = self.length - len(self.tail), self.tail + new
        else:  # not local to the tokens: the whole text, as before (and committed whole)
            new = text = self._decode(ids)
            start = 0
        hits = [(start + i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if not new.endswith(SPLIT) or len(ids) - read > PENDING:
            self.commits.append(len(ids))
            while len(self.commits) > 1 and self.commits[1] <= len(ids) - CONTEXT:
                self.commits.popleft()
            if not local:
                self.length, self.tail = 0, ""
            self.length += len(new)
            self.tail = (self.tail + new)[-self.keep :] if self.keep else ""
        return min(hits) if hits else None
