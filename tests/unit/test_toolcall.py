"""The one tool-call format: what the prompts show is what the parser reads back."""

from __future__ import annotations

import json

from core.toolcall import TOOL_CALL_BEGIN, TOOL_CALL_END, format_call, parse_tool_calls, strip_tool_calls
from engines.chat import tools_system_text
from grpo.tasks import EXAMPLE


def test_a_formatted_call_parses_back_to_itself() -> None:
    args = {"query": "SELECT 1", "nested": {"k": [1, 2]}, "quote": 'a "b" </tool_call>'}
    for sep in ("", "\n"):
        text = "Let me look.\n" + format_call("sql_query", args, sep=sep)
        assert text.count(TOOL_CALL_BEGIN) == 1 and text.endswith(TOOL_CALL_END)
        parsed = parse_tool_calls(text)
        assert parsed is not None and not parsed.errors
        assert [(c.name, dict(c.arguments)) for c in parsed.calls] == [("sql_query", args)]
        assert strip_tool_calls(text) == "Let me look."


def test_prompts_teach_the_format_the_parser_reads() -> None:
    """The chat template's tool text and the GRPO few-shot example use the same tags as the parser."""
    system = tools_system_text([json.dumps({"name": "f", "parameters": {}})])
    assert TOOL_CALL_BEGIN in system and TOOL_CALL_END in system
    shown = next(m["content"] for m in EXAMPLE if m["role"] == "assistant" and TOOL_CALL_BEGIN in m["content"])
    parsed = parse_tool_calls(shown)
    assert parsed is not None and [c.name for c in parsed.calls] == ["calculator"]
