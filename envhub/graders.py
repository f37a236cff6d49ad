"""Deterministic graders: answer text and reference in, a score in [0, 1] out.

Invariant: a pure function of (answer, reference): no randomness, no I/O, no model.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


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
