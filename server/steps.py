"""An accepted Step: what ``Bridge.prepare_step`` hands back, and how its tokens stream.

Acceptance is a type, not a message: ``prepare_step`` either raises (nothing was written) or returns
a ``StepHandle`` (the episode is busy, the turn routed and, for a plain episode, opened with its
observation appended). The caller then iterates ``updates()`` and always calls ``close()``.

The path of one Step has one async-generator layer between the RPC handler and the engine adapter:
``StepHandle.updates`` hands out ``Turns.generate`` -> ``Engine.generate`` itself; two with persistence
(``_updates`` holds the last update back) and three with an environment, whose tool loop samples several
turns: ``_updates`` -> ``_env_turns`` -> ``Turns.generate``.

Invariants:
- ``close`` runs exactly once whatever happened (stream finished, failed, cancelled, never started):
  it closes a turn left open as ABORT and releases the episode (busy flag, in-flight count, the
  persisted record and its lease);
- with persistence on, the Step's last update is held back until the record is written and the
  lease released, so a client that saw the turn end can at once step or end it on any bridge.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

from core.types import FinishReason, Origin, SamplingParams
from engines.base import Tokenizer
from server.calls import StepUpdate
from server.envsession import EnvSession
from server.episodes import NAN, Episode, Turn
from server.errors import InvalidArgument
from server.turns import Turns


@dataclass(eq=False, slots=True)
class StepHandle:
    """One accepted Step (see module docstring)."""

    episode: Episode
    turns: Turns
    params: SamplingParams
    step_seed: bool  # the Step set its own seed
    deadline: float | None
    release: Callable[[StepHandle], Awaitable[None]]
    hold_last: bool  # persistence on: the last update waits for ``close``
    tenant: str
    leased: bool  # holds the episode's persistence lease
    observation: list[int]  # appended when the turn opens (a plain Step: at acceptance)
    turn: Turn | None = None  # a plain Step's turn, opened at acceptance
    turn_params: SamplingParams | None = None
    session: EnvSession | None = None
    tokenizer: Tokenizer | None = None
    opened_turns: int = 0  # how many turns the episode had when the Step was accepted
    salt: str = ""  # the salt the Step was routed with (``Turns.open``: its turns reuse it) ...
    salt_version: int = -1  # ... and the policy version it names
    closed: bool = False

    def updates(self) -> AsyncGenerator[StepUpdate, None]:
        """The tokens as they are appended to the episode; the last update has ``turn`` and ``last``.

        A plain Step whose last update need not wait (no persistence) streams its turn as is: the caller's
        ``close`` releases it (one async-generator layer less on every Step and chunk)."""
        if self.session is None and not self.hold_last:
            assert self.turn is not None and self.turn_params is not None
            return self.turns.generate(self.episode, self.turn, self.turn_params, self.deadline)
        return self._updates()

    async def _updates(self) -> AsyncGenerator[StepUpdate, None]:
        """``updates`` of an env Step or of a Step whose last update waits for ``close``."""
        final: StepUpdate | None = None
        if self.session is not None:
            source = self._env_turns(self.session)
        else:
            assert self.turn is not None and self.turn_params is not None
            source = self.turns.generate(self.episode, self.turn, self.turn_params, self.deadline)
        try:
            async for update in source:
                if self.hold_last and update.last and update.turn is not None:
                    final = update
                    break
                yield update
        finally:
            await source.aclose()
            await self.close()
        if final is not None:
            yield final

    async def close(self) -> None:
        """Close a turn left open (ABORT, partial tokens kept) and release the episode; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.turn is not None and self.turn.finish_reason is None:  # accepted, but its stream never ran
            self.turns.close(self.turn, FinishReason.ABORT, None)
        await self.release(self)

    async def _env_turns(self, session: EnvSession) -> AsyncGenerator[StepUpdate, None]:
        """Sample turns and run their tool calls until the environment's loop stops or a bound is hit."""
        episode, tokenizer = self.episode, self.tokenizer
        assert tokenizer is not None  # checked at StartEpisode
        turns = 0
        observation: list[int] = []
        text = session.pending  # tool calls an interrupted Step left unrun go first
        # A turn cut short (cancel, deadline) is continued by the next one: the loop reads them as one message.
        last = episode.turns[-1] if episode.turns else None
        start = last.generation_start if text is None and last and last.finish_reason == FinishReason.ABORT else None
        while True:
            if text is None:
                turn, params = self.turns.open(
                    episode, observation, self.params, self.step_seed, self.salt, self.salt_version
                )
                try:  # a Step closed before or inside the turn closes it (ABORT): its adapter version is let go
                    if observation:
                        n = len(observation)
                        yield StepUpdate(tuple(observation), (NAN,) * n, (Origin.ENV,) * n)
                    # aclosing: a Step closed mid-turn closes the turn now, not when the generator is collected.
                    stream = self.turns.generate(episode, turn, params, self.deadline, session.env.grammar)
                    async with aclosing(stream):
                        async for update in stream:
                            yield update if update.turn is None else replace(update, last=False)
                finally:
                    self.turns.close(turn, FinishReason.ABORT, None)  # (a no-op for a turn already closed)
                turns += 1
                if turn.finish_reason == FinishReason.ABORT:  # the engine aborted it: the next Step continues it
                    break
                text = tokenizer.decode(episode.token_ids[turn.generation_start if start is None else start : turn.end])
                start = None
            decision = await session.run_turn(text, self.deadline)
            text = None
            if decision is None or session.stopped:
                break
            try:
                observation = tokenizer.render_continuation(decision.observation, episode.token_ids)
            except InvalidArgument as exc:
                session.stop("env_error", exc.message)
                break
            if not self.turns.has_room(episode, len(observation)):
                session.stop("context_exhausted")
                break
        outcome = session.outcome(turns)
        if outcome.reason == "" and turns and episode.turns[-1].finish_reason == FinishReason.ABORT:
            outcome = replace(outcome, reason="aborted")
        yield StepUpdate((), (), (), episode.turns[-1], last=True, env=outcome)
