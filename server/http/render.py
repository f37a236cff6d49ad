"""OpenAI chat shapes <-> the bridge's messages, tools and tokens.

- ``engine_messages``: OpenAI messages as ``core.types.Message`` (text parts joined; an assistant
  message's tool calls written back in the ``<tool_call>`` format of ``core.toolcall``, so a
  re-rendered history holds what the model wrote);
- ``canonical``: the form two histories are compared in (append-only check): role, text, tool calls by
  name and parsed arguments, so a client that re-serialises JSON arguments still extends its session;
- ``assistant_message``: a sampled turn's text as an OpenAI assistant message, tool calls parsed;
- ``logprob_content``: chat logprobs entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Sequence
from typing import Any

from core.toolcall import (
    END_MARKERS,
    TOOL_CALL_BEGIN,
    format_call,
    parse_tool_calls,
    strip_end_markers,
    strip_tool_calls,
)
from core.types import Message
from engines.base import Tokenizer
from server.http.errors import BadParam
from server.http.models import ChatMessage, Tool

LOGPROB_FLOOR = -9999.0  # vLLM's encoding of -inf


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def _arguments(raw: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise BadParam(where, f"{where} is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadParam(where, f"{where} must be a JSON object")
    return value


def engine_messages(messages: Sequence[ChatMessage], offset: int = 0) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(messages, offset):
        content = text_of(m.content)
        for j, call in enumerate(m.tool_calls or ()):
            args = _arguments(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
            content += format_call(call.function.name, args, sep="\n")
        role = "system" if m.role == "developer" else m.role
        out.append(Message(role=role, content=content, name=m.name or ""))
    return tuple(out)


def canonical(messages: Sequence[ChatMessage]) -> list[tuple[str, str, str]]:
    """(role, text, tool calls) per message: equal for the same conversation however it was serialised."""
    out: list[tuple[str, str, str]] = []
    for m in messages:
        calls = [
            (c.function.name, _arguments(c.function.arguments, "tool_calls.function.arguments"))
            for c in m.tool_calls or ()
        ]
        role = "system" if m.role == "developer" else m.role
        out.append((role, text_of(m.content).strip(), json.dumps(calls, sort_keys=True)))
    return out


def tool_schemas(tools: Sequence[Tool] | None) -> tuple[str, ...]:
    """OpenAI tools as the bridge's tool schemas (one JSON function object each)."""
    return tuple(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools or ())


def check_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> bool:
    """Whether to parse tool calls; refuses choices the engines cannot enforce."""
    if choice is None or choice == "auto":
        return has_tools
    if choice == "none":
        return False
    raise BadParam(
        "tool_choice",
        f"tool_choice {choice!r} is not supported: the engines cannot force a tool call; use 'auto' or 'none'",
    )


def assistant_message(text: str, parse_tools: bool) -> tuple[dict[str, Any], ChatMessage]:
    """The OpenAI assistant message of a turn, and the same message as the client will send it back."""
    text = strip_end_markers(text)
    parsed = parse_tool_calls(text) if parse_tools else None
    calls = []
    if parsed is not None and parsed.calls:
        text = strip_tool_calls(text)
        for c in parsed.calls:
            args = json.dumps(dict(c.arguments))
            calls.append(
                {
                    "id": "call_" + secrets.token_hex(12),
                    "type": "function",
                    "function": {"name": c.name, "arguments": args},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, ChatMessage.model_validate(message)


def visible_text(text: str, parse_tools: bool) -> str:
    """The part of a turn's text so far that its final message content surely starts with (streaming).

    Held back: tool-call blocks (sent as ``tool_calls`` at the end), a possibly partial end marker or
    ``<tool_call>`` tag, trailing whitespace and an incomplete UTF-8 character.
    """
    if parse_tools and (k := text.find(TOOL_CALL_BEGIN)) >= 0:
        text = text[:k]
    text = strip_end_markers(text)
    for marker in (*END_MARKERS, TOOL_CALL_BEGIN):
        for j in range(len(marker) - 1, 0, -1):
            if text.endswith(marker[:j]):
                text = text[:-j]
                break
    return text.rstrip().rstrip("\ufffd")


def token_text(tok: Tokenizer | None, token_id: int, as_ids: bool) -> str:
    if as_ids or tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id])


def finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def logprob_content(
    tok: Tokenizer | None, ids: Sequence[int], lps: Sequence[float], as_ids: bool
) -> list[dict[str, Any]]:
    """Chat / token-route logprobs entries, one per sampled token (the sampled token's logprob only)."""
    out = []
    for t, lp in zip(ids, lps, strict=True):
        text = token_text(tok, t, as_ids)
        out.append({"token": text, "logprob": finite(lp), "bytes": list(text.encode()), "top_logprobs": []})
    return out


def completion_logprobs(
    tok: Tokenizer | None, ids: Sequence[int], lps: Sequence[float], as_ids: bool, offset: int = 0
) -> dict[str, Any]:
    """Legacy completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
    tokens = [token_text(tok, t, as_ids) for t in ids]
    values = [finite(x) for x in lps]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": [{s: v} for s, v in zip(tokens, values, strict=True)],
        "text_offset": offsets,
    }
