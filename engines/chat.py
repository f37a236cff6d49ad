"""A Hugging Face tokenizer behind the ``engines.base.Tokenizer`` protocol, with append-only chat rendering.

Invariant (DESIGN.md, invariant 1): a continuation is rendered from the *new* messages only and appended to the
episode's ids as they are; earlier tokens are never re-rendered or re-tokenized. The text of new messages is what
the model's chat template emits for them after an anchor conversation, so the result is the template's own output,
for any template that renders each message independently of the ones after it. A template that is not
append-only (the anchor's rendering is not a prefix of the longer one) is an error, never silently papered over.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from core.errors import InvalidArgument
from core.toolcall import TOOL_CALL_BEGIN, TOOL_CALL_END
from core.types import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ANCHOR = {"role": "system", "content": "anchor"}
_MARK = "\x00primerl-mark\x00"


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def tools_system_text(tool_schemas: Sequence[str]) -> str:
    """The system text that lists tools for templates without native tool support (Hermes-style tags)."""
    tools = "\n".join(json.dumps(json.loads(s), separators=(",", ":")) for s in tool_schemas)
    return (
        "You may call one or more functions to assist with the user query. Function signatures:\n"
        f"<tools>\n{tools}\n</tools>\n"
        f'To call a function, reply with {TOOL_CALL_BEGIN}{{"name": NAME, "arguments": {{...}}}}{TOOL_CALL_END}.'
    )


class HFTokenizer:
    """``Tokenizer`` over a ``transformers`` tokenizer and its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        # What the template writes after an assistant message's content: the end-of-turn marker and any
        # separator. A turn that ended on EOS already has the marker; one cut by max_tokens has neither.
        rendered = self._text([_ANCHOR, {"role": "assistant", "content": _MARK}], generation_prompt=False)
        self._close = rendered.split(_MARK, 1)[1]
        eos_text = str(tokenizer.decode(list(self.eos_token_ids[:1]))) if self.eos_token_ids else ""
        self._after_eos = self._close[len(eos_text) :] if eos_text and self._close.startswith(eos_text) else ""

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped transformers tokenizer (the speculation layer builds its grammar tokenizer from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):  # pragma: no cover - tokenize=False always returns text
            raise TypeError(f"chat template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def render_prompt(self, messages: Sequence[Message], tool_schemas: Sequence[str] = ()) -> list[int]:
        convo: list[dict[str, Any]] = _as_dicts(messages)
        if tool_schemas:
            try:
                tools = tools_system_text(tool_schemas)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"a tool schema is not valid JSON: {exc}") from None
            if convo and convo[0]["role"] == "system":
                convo[0] = {"role": "system", "content": f"{convo[0]['content']}\n\n{tools}"}
            else:
                convo.insert(0, {"role": "system", "content": tools})
        return self.encode(self._text(convo, generation_prompt=True))

    def render_continuation(self, messages: Sequence[Message], history: Sequence[int]) -> list[int]:
        base = self._text([_ANCHOR], generation_prompt=False)
        full = self._text([_ANCHOR, *_as_dicts(messages)], generation_prompt=True)
        if not full.startswith(base):
            raise InvalidArgument("the model's chat template is not append-only; send observation token ids instead")
        close = self._after_eos if history and history[-1] in self.eos_token_ids else self._close
        return self.encode(close + full[len(base) :])
