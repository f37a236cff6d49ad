"""Tool calls through the chat shapes: parsed into ``tool_calls``, and recognised when the client sends them back.
Stop strings as a choice streams: what decoding the whole choice on every update found, for a bounded work per
update."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from core.toolcall import format_call
from server.http.models import ChatMessage
from server.http.render import assistant_message, canonical, engine_messages, visible_text
from server.http.runner import Choice, Runner


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


class Counting:
    """A tokenizer's ``decode`` that counts the ids it decodes, per update."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.work = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.work += len(ids)
        return self._decode(ids)


def whole_text_scan(decode: Callable[[Sequence[int]], str], updates: list[list[int]], stops: list[str]) -> Any:
    """What the front door did before: decode the whole choice on each update and search it all."""
    ids: list[int] = []
    for update in updates:
        ids.extend(update)
        text = decode(ids)
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return len(ids), min(hits)
    return len(ids), None


def runner_scan(decode: Callable[[Sequence[int]], str], updates: list[list[int]], stops: list[str]) -> Any:
    """The front door's stop matching (``Runner._match_stop``), update by update; the decode work per update."""
    tok = Counting(decode)
    runner = Runner(SimpleNamespace(tokenizer=tok), None, None)  # type: ignore[arg-type]
    c = Choice(0, None, None)  # type: ignore[arg-type]
    work = []
    for update in updates:
        c.token_ids.extend(update)
        tok.work = 0
        runner._match_stop(c, stops)
        work.append(tok.work)
        if c.stop_hit is not None:
            return (len(c.token_ids), (c.text_end, c.stop_hit)), work
    return (len(c.token_ids), None), work


WORDS = ["a", "b", "the", "cat", ".", "n't", "'s", "é", "✓", "hello", ","]
TEXT = st.text(alphabet="ab .,é✓🙂\n", min_size=1, max_size=200)


def split(draw: Any, n: int, most: int) -> list[int]:
    """Cut points splitting ``n`` items into runs of 1 to ``most``."""
    cuts, at = [0], 0
    while at < n:
        at = min(n, at + draw(st.integers(1, most)))
        cuts.append(at)
    return cuts


@st.composite
def streams(draw: Any) -> tuple[Callable[[Sequence[int]], str], list[list[int]], list[str], bool]:
    """A tokenizer (bytes: characters split across tokens; words joined by spaces, with or without a clean-up
    that reaches across tokens), a choice's ids cut into updates, and stop strings (some from the text, so
    they straddle tokens and updates). The flag says whether the tokenizer's text is local to its tokens."""
    kind = draw(st.sampled_from(["bytes", "words", "cleanup", "merge"]))
    if kind == "bytes":
        raw = draw(TEXT).encode()
        cuts = split(draw, len(raw), 4)
        pieces = [raw[a:b] for a, b in pairwise(cuts)]

        def decode(ids: Sequence[int]) -> str:
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

        ids = list(range(len(pieces)))
    else:
        vocab = WORDS
        ids = draw(st.lists(st.integers(0, len(vocab) - 1), min_size=1, max_size=120))
        patterns = {"words": [], "cleanup": [(" .", "."), (" n't", "n't"), (" ,", ",")], "merge": [("a b", "X")]}

        def decode(ids: Sequence[int], rules: list[tuple[str, str]] = patterns[kind]) -> str:
            text = " ".join(vocab[i] for i in ids)
            for old, new in rules:
                text = text.replace(old, new)
            return text

    cuts = split(draw, len(ids), 3)
    updates = [ids[a:b] for a, b in pairwise(cuts)]
    text = decode(ids)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a : a + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(alphabet="ab .é✓🙂", min_size=1, max_size=4)))
    return decode, updates, stops, kind in ("bytes", "words")


@settings(max_examples=400, deadline=None)
@given(streams())
def test_stop_strings_match_as_a_whole_text_decode_did_with_bounded_work_per_update(stream: Any) -> None:
    decode, updates, stops, local = stream
    found, work = runner_scan(decode, updates, stops)
    assert found == whole_text_scan(decode, updates, stops)  # the same stop, at the same index, on the same update
    if local:  # decoding only what is new (and a few tokens of context): never the whole choice again
        assert max(work) <= 40, work


def test_a_long_choice_is_not_decoded_again_on_every_update() -> None:
    vocab = [f"w{i}" for i in range(50)]
    ids = [i % 50 for i in range(2000)]
    updates = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    found, work = runner_scan(lambda ids: " ".join(vocab[i] for i in ids), updates, ["never", "w49 w0 x"])
    assert found == (2000, None) and max(work) <= 20 and sum(work) <= 20 * len(updates), (max(work), sum(work))
