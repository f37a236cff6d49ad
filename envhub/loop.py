"""The server-side tool loop: sampled turn text in, observation messages and a decision out.

The bridge calls ``ToolLoop.on_turn(text)`` after each sampled turn of an episode that has
an environment attached:

- the text holds one or more ``<tool_call>...</tool_call>`` blocks (the generic format and
  SmolLM2's, whose payload is a JSON list of calls) -> each call is executed in the
  environment, the ``tool`` messages are returned with ``should_continue=True``; the bridge
  renders them as env tokens (loss mask 0) and samples the next turn;
- a block that is not valid JSON -> an error ``tool`` message (the model can retry);
- no block -> the text is the final answer: it is graded, ``done=True``, ``reward`` set;
- the bound (``max_tool_calls`` per episode) is reached -> the turn is graded as the final
  answer with its tool calls stripped, ``truncated=True``.

Invariants: at most ``max_tool_calls`` calls are executed per episode and at most
``max_calls_per_turn`` per turn; an unparsable block or entry uses up one call of the episode's
budget too (as it uses up a turn), so ``on_turn`` returns ``should_continue=False`` after at most
``max_tool_calls + 1`` turns even for a model that only writes broken calls; the loop never
raises for anything the model wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engines.types import Message
from envhub.base import Environment
from envhub.config import EnvHubConfig, LoopConfig
from envhub.grammar import TOOL_CALL_BEGIN, TOOL_CALL_END, ToolGrammar, grammar_for
from envhub.types import FinalAnswer, ResetResult, ToolCall

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)
_DECODER = json.JSONDecoder()


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


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]  # one message per malformed block / entry


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


# End-of-turn markers a decoder may leave on the text (ChatML/SmolLM2, GPT-2, Llama 2/3).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end|>")


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
    kept, pos = [], 0
    for _, start, end in _blocks(text):
        kept.append(text[pos:start])
        pos = end
    return ("".join(kept) + text[pos:]).strip()


@dataclass(frozen=True, slots=True)
class LoopDecision:
    """What the bridge does after a turn."""

    observation: tuple[Message, ...]  # render and append as env tokens when should_continue
    should_continue: bool  # sample another turn
    done: bool  # the environment graded the episode
    reward: float | None  # the shaped reward once done
    reason: str  # "tool_call" | "final_answer" | "max_tool_calls" | "done"
    tool_calls: int  # calls executed in this turn
    truncated: bool = False


class ToolLoop:
    """Bounded tool loop over one environment episode (one instance per episode)."""

    def __init__(self, env: Environment, config: LoopConfig | None = None) -> None:
        self.env = env
        self.config = config or LoopConfig()
        self.tool_calls = 0  # executed so far in this episode
        self.malformed = 0  # tool-call blocks or entries that could not be parsed (they count toward the bound)
        self.turns = 0
        self.done = False
        self.reward: float | None = None

    async def on_turn(self, text: str) -> LoopDecision:
        """Handle the sampled text of one assistant turn (trailing end-of-turn markers are ignored)."""
        self.turns += 1
        text = strip_end_markers(text)
        if self.done:
            return LoopDecision((), False, True, self.reward, "done", 0)
        parsed = parse_tool_calls(text)
        if parsed is None:
            return await self._finish(text, "final_answer", truncated=False)
        used = self.tool_calls + self.malformed
        if used >= self.config.max_tool_calls:
            return await self._finish(strip_tool_calls(text), "max_tool_calls", truncated=True)
        messages = [Message(role="tool", content=err, name="tool_call") for err in parsed.errors]
        budget = min(self.config.max_calls_per_turn, self.config.max_tool_calls - used)
        executed = 0
        for call in parsed.calls:
            if executed >= budget:
                skipped = f"error (limit): skipped {call.name!r}: tool call bound reached"
                messages.append(Message(role="tool", content=skipped, name=call.name))
                continue
            result = await self.env.step(call)
            executed += 1
            messages.extend(result.observation)
        self.tool_calls += executed
        self.malformed += len(parsed.errors)
        if not parsed.calls and not parsed.errors:
            messages.append(Message(role="tool", content="error (invalid): empty tool call", name="tool_call"))
            self.malformed += 1
        return LoopDecision(tuple(messages), True, False, None, "tool_call", executed)

    async def _finish(self, text: str, reason: str, truncated: bool) -> LoopDecision:
        result = await self.env.step(FinalAnswer(text))
        self.done = True
        self.reward = result.reward
        return LoopDecision(result.observation, False, True, result.reward, reason, 0, truncated)


@dataclass(frozen=True, slots=True)
class EnvEpisode:
    """An environment episode opened for the bridge: what to prompt with, and the loop to drive."""

    loop: ToolLoop
    opening: ResetResult

    @property
    def prompt_messages(self) -> tuple[Message, ...]:
        """The opening messages (system prompt with the call format, then the task)."""
        return self.opening.messages

    @property
    def tool_schemas(self) -> tuple[str, ...]:
        """One JSON string per tool (OpenAI function entries), as ``Tokenizer.render_prompt`` takes them."""
        return tuple(t.to_json() for t in self.opening.tools)

    @property
    def grammar(self) -> ToolGrammar:
        """The tool-call grammar for the speculation layer."""
        return grammar_for(self.loop.env.name, self.opening.tools)

    async def close(self) -> None:
        await self.loop.env.close()


async def start_env_episode(
    name: str, config: EnvHubConfig | None = None, task_id: str | None = None, seed: int | None = None
) -> EnvEpisode:
    """Make the registered environment ``name``, reset it, and wrap it in a ``ToolLoop``."""
    from envhub.registry import make_env

    config = config or EnvHubConfig()
    env = make_env(name, config)
    try:
        opening = await env.reset(task_id=task_id, seed=seed)
    except BaseException:
        await env.close()
        raise
    return EnvEpisode(loop=ToolLoop(env, config.loop), opening=opening)
