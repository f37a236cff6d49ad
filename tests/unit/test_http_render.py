"""Tool calls through the chat shapes: parsed into ``tool_calls``, and recognised when the client sends them back."""

from __future__ import annotations

import json

from core.toolcall import format_call
from server.http.models import ChatMessage
from server.http.render import assistant_message, canonical, engine_messages, visible_text


def test_a_tool_call_is_parsed_and_its_echo_extends_the_history() -> None:
    text = "Let me check." + format_call("get_weather", {"city": "Paris"}, sep="\n") + "<|im_end|>"
    message, recorded = assistant_message(text, parse_tools=True)
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The SDK sends it back re-serialised (other spacing, content None when empty): the same history.
    echoed = dict(message, tool_calls=[dict(call, function={"name": "get_weather", "arguments": '{ "city":"Paris" }'})])
    assert canonical([ChatMessage.model_validate(echoed)]) == canonical([recorded])
    # Re-rendered (a fork), the call is written back in the model's own format.
    (rendered,) = engine_messages([recorded])
    assert "<tool_call>" in rendered.content and "get_weather" in rendered.content
    assert assistant_message(text, parse_tools=False)[0]["content"].endswith("</tool_call>")


def test_streamed_text_never_shows_what_the_final_message_drops() -> None:
    assert visible_text("Hello <|im_", False) == "Hello"
    assert visible_text("Sure <tool", True) == "Sure"
    assert visible_text('Sure <tool_call>{"name"', True) == "Sure"
