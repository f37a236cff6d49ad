"""The tool-call format of an assistant turn: the one place that knows ``<tool_call>...</tool_call>``.

The chat template (``engines.chat``) tells the model this format; the env hub's tool loop parses
it, its environments show it in their prompts, the speculation grammar constrains it and the GRPO
raters score it. All of them import it from here, so the tags, the rendering of one call and the
parser cannot drift apart.

Format: one or more blocks ``<tool_call>PAYLOAD</tool_call>`` anywhere in the turn's text, where
PAYLOAD is ``{"name": ..., "arguments": {...}}`` or a JSON list of those (SmolLM2's native form),
with optional whitespace around it. On parsing, ``parameters`` is accepted for ``arguments`` and
``arguments`` may be a JSON string; an unterminated last block (the turn hit max_tokens) is parsed
as far as it goes. Invariant: nothing here raises for anything a model wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# End-of-turn markers a decoder may leave on the text (ChatML/SmolLM2, GPT-2, Llama 2/3).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end|>")

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed tool call of the model."""

    name: str
    arguments: Mapping[str, Any]
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]  # one message per malformed block / entry


def format_call(name: str, arguments: Mapping[str, Any], *, sep: str = "") -> str:
    """One call block as the model should write it; ``sep`` goes inside both tags (SmolLM2 writes ``"\\n"``)."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)})
    return f"{TOOL_CALL_BEGIN}{sep}{payload}{sep}{TOOL_CALL_END}"


def _blocks(text: str) -> list[tuple[str, int, int]]:
    """(payload, start, end) of each ``<tool_call>`` block.

    A payload that parses as JSON ends where the JSON value ends, so a string argument may contain
    ``</tool_call>`` (the grammar allows it), and a turn cut by max_tokens inside the end tag (``</tool``)
    still parses; otherwise the block runs to the first end tag (or the end).
    """
    out = []
    pos = 0
    while (start := text.find(TOOL_CALL_BEGIN, pos)) >= 0:
        body = start + len(TOOL_CALL_BEGIN)
        try:
            _, stop = _DECODER.raw_decode(text, len(text) - len(text[body:].lstrip()))
        except json.JSONDecodeError:
            stop = -1
        tail = text[stop:].lstrip() if stop >= 0 else ""
        if stop >= 0 and tail.startswith(TOOL_CALL_END):
            out.append((text[body:stop], start, len(text) - len(tail) + len(TOOL_CALL_END)))
        elif stop >= 0 and TOOL_CALL_END.startswith(tail):  # the text ends here, maybe cut mid-tag (max_tokens)
            out.append((text[body:stop], start, len(text)))
        else:
            m = _BLOCK_RE.match(text, start)
            assert m is not None  # the pattern matches from any begin tag
            out.append((m.group(1), start, m.end()))
        pos = out[-1][2]
    return out


def parse_tool_calls(text: str) -> ParsedCalls | None:
    """The tool calls in ``text``, or None when it holds no ``<tool_call>`` block.

    A block's payload is ``{"name": ..., "arguments": {...}}`` or a JSON list of those
    (SmolLM2); ``parameters`` is accepted for ``arguments``, and ``arguments`` may be a JSON
    string. An unterminated last block (the turn hit max_tokens) is parsed as far as it goes.
    """
    blocks = _blocks(text)
    if not blocks:
        return None
    calls: list[ToolCall] = []
    errors: list[str] = []
    for raw, _, _ in blocks:
        payload = raw.strip()
        try:
            value = json.loads(payload)
        except json.JSONDecodeError as e:
            errors.append(f"error (invalid): tool call is not valid JSON ({e.msg} at char {e.pos}): {payload[:200]!r}")
            continue
        for entry in value if isinstance(value, list) else [value]:
            call = _to_call(entry)
            if isinstance(call, str):
                errors.append(call)
            else:
                calls.append(call)
    return ParsedCalls(tuple(calls), tuple(errors))


def _to_call(entry: object) -> ToolCall | str:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return 'error (invalid): a tool call must be an object {"name": "<tool>", "arguments": {...}}'
    args = entry.get("arguments", entry.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"error (invalid): arguments of {entry['name']!r} are not a JSON object"
    if not isinstance(args, dict):
        return f"error (invalid): arguments of {entry['name']!r} must be a JSON object"
    return ToolCall(name=entry["name"], arguments=args, call_id=str(entry.get("id", "")))


def strip_end_markers(text: str, markers: tuple[str, ...] = END_MARKERS) -> str:
    """``text`` without trailing end-of-turn markers and whitespace."""
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for m in markers:
            if text.endswith(m):
                text = text[: -len(m)].rstrip()
                changed = True
    return text


def strip_tool_calls(text: str) -> str:
    """``text`` without its tool-call blocks (what is left is the turn's prose)."""
    kept, pos = [], 0
    for _, start, end in _blocks(text):
        kept.append(text[pos:start])
        pos = end
    return ("".join(kept) + text[pos:]).strip()
