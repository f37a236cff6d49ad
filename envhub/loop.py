"""The server-side tool loop: sampled turn text in, observation messages and a decision out.

The bridge calls ``ToolLoop.on_turn(text)`` after each sampled turn of an episode that has
an environment attached:

- the text holds one or more tool-call blocks (``core.toolcall``: the generic format and
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

from dataclasses import dataclass

from core.grammar import ToolGrammar
from core.toolcall import parse_tool_calls, strip_end_markers, strip_tool_calls
from core.types import Message
from envhub.base import Environment
from envhub.config import EnvHubConfig, LoopConfig
from envhub.grammar import grammar_for
from envhub.types import FinalAnswer, ResetResult


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
