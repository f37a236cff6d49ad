"""The canonical JSON of signed content: one function, so every signed byte string is encoded one way.

Sorted keys, no whitespace, UTF-8 (no ``\\u`` escapes), NaN and Infinity refused (``ValueError``: JSON has no
such numbers, and ``json`` would write ``NaN``, which no other parser reads back). Users: the verifier's in-toto
Statements and DSSE envelopes (the log's leaves), and the sandbox policy digest a verdict signs.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (module docstring); ``ValueError`` on NaN or Infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
