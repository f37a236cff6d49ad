"""Tool-call grammars compiled with llguidance (token masks, fast-forward tokens, prefix checks).

A ``ToolGrammar`` (``core.grammar.ToolGrammar``: the env's tool schemas) becomes one Lark grammar for the
model's tool-call format: optional whitespace, ``<tool_call>``, one call object or a JSON list of
them (SmolLM2), optional whitespace, ``</tool_call>``. The call object is llguidance's ``%json``
of ``ToolGrammar.call_schema()`` with fixed separators (``json.dumps`` style, the way envhub
renders calls: ``core.toolcall.format_call``), so keys, ``name`` constants and punctuation are forced bytes.

Invariants: a token sequence the matcher accepts decodes to a block ``core.toolcall`` parses as
calls of the env's tools; forced tokens come from ``LLMatcher.compute_ff_tokens``, which holds
back token boundaries a valid continuation could merge across (canonical tokenisation).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import llguidance.hf

from core.grammar import ToolGrammar

_TOKENIZERS: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}  # keeps the HF tokenizer alive: ids stay unique
_LOCK = threading.Lock()


def ll_tokenizer(hf_tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance view of a Hugging Face fast tokenizer (built once per tokenizer object).

    Accepts the tokenizer itself or ``engines.chat.HFTokenizer`` (which wraps it as ``_tok``).
    """
    hf_tokenizer = getattr(hf_tokenizer, "_tok", hf_tokenizer)
    key = id(hf_tokenizer)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is None:
            hit = (hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer))
            _TOKENIZERS[key] = hit
        return hit[1]


def tool_call_lark(grammar: ToolGrammar, item_separator: str = ", ", key_separator: str = ": ") -> str:
    """The Lark source of one tool-call block of ``grammar``'s tools."""
    opts = {"whitespace_flexible": False, "item_separator": item_separator, "key_separator": key_separator}
    schema = {**grammar.call_schema(), "x-guidance": opts}
    sep = json.dumps(item_separator.strip() or ",")
    return "\n".join(
        [
            f"start: WS {json.dumps(grammar.begin)} WS body WS {json.dumps(grammar.end)}",
            f'body: call | "[" WS call (WS {sep} WS call)* WS "]"',
            f"call: %json {json.dumps(schema)}",
            r"WS: /[ \t\n]*/",
        ]
    )


class CompiledToolGrammar:
    """A validated grammar plus a pristine matcher to copy (compiling is the slow part)."""

    def __init__(self, grammar: ToolGrammar, tokenizer: llguidance.LLTokenizer, **separators: str) -> None:
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.lark = tool_call_lark(grammar, **separators)
        error = llguidance.LLMatcher.validate_grammar(self.lark, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"tool-call grammar of env {grammar.env_name!r} does not compile: {error}")
        self._pristine = llguidance.LLMatcher(tokenizer, self.lark, log_level=0)

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the start of a block."""
        return self._pristine.deep_copy()

    def accepts(self, tokens: list[int]) -> bool:
        """True iff ``tokens`` is a complete, valid tool-call block."""
        m = self.matcher()
        return m.consume_tokens(tokens) and m.is_accepting()
