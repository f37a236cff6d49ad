"""Env hub episodes attached to bridge episodes: the per-episode state of the server-side tool loop.

A bridge episode started with ``env`` owns one ``EnvSession`` (an ``envhub.loop.EnvEpisode``: the
environment, reset to a task, and its ``ToolLoop``). ``Bridge.step`` samples a turn, hands its text to
``EnvSession.run_turn`` and, while the loop says so, appends the tool results as env tokens and samples
again.

Invariants:
- every session's environment is closed exactly once (EndEpisode, discard, a failed StartEpisode, or
  bridge shutdown), and closing never raises;
- ``stopped`` is "" while the loop may run another turn; once set, Step is refused;
- ``pending`` holds the text of a sampled turn whose tool calls were interrupted (cancel or deadline);
  the next Step runs them before sampling, so each tool call the model wrote gets its result;
- nothing the model writes and nothing an environment raises escapes ``run_turn`` except cancellation
  and the Step's deadline: a ``ToolError`` becomes an error observation, any other failure ends the
  loop with reason ``env_error``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from core.types import EnvStatus, Message
from envhub.config import EnvHubConfig
from envhub.loop import EnvEpisode, LoopDecision, ToolLoop, start_env_episode
from envhub.registry import names as env_names
from server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, PrimeRLError, ToolError

log = logging.getLogger("primerl.server")

CLOSE_TIMEOUT_S = 10.0  # an environment's close (browser, database) gets this long, then it is abandoned


# Where an episode's tool loop stands after a Step (``TurnDone.env`` on the wire): the type the trainer client
# returns too (``rl_client.EnvStatus``).
EnvOutcome = EnvStatus


@dataclass(eq=False, slots=True)
class EnvSession:
    """One bridge episode's environment episode and where its tool loop stands."""

    name: str
    env: EnvEpisode
    max_turns: int  # on_turn calls per episode at most: a backstop (the loop ends within max_tool_calls + 1)
    stopped: str = ""
    error: str = ""
    truncated: bool = False
    pending: str | None = None
    closed: bool = False

    @property
    def loop(self) -> ToolLoop:
        return self.env.loop

    @property
    def task_id(self) -> str:
        return self.env.opening.task_id

    def check_steppable(self, episode_id: str) -> None:
        if not self.stopped:
            return
        if self.loop.done:
            raise FailedPrecondition(
                f"episode {episode_id!r}: environment {self.name!r} already graded it (reward {self.loop.reward}); "
                "end it with EndEpisode"
            )
        detail = f": {self.error}" if self.error else ""
        raise FailedPrecondition(
            f"episode {episode_id!r}: the tool loop of environment {self.name!r} stopped ({self.stopped}{detail}); "
            "end it with EndEpisode"
        )

    def stop(self, reason: str, error: str = "") -> None:
        self.stopped, self.error = reason, error

    async def run_turn(self, text: str, deadline: float | None) -> LoopDecision | None:
        """The loop's decision on a sampled turn, or None when the environment failed (``stopped`` is set)."""
        self.pending = text
        try:
            async with asyncio.timeout_at(deadline) as scope:
                decision = await self.loop.on_turn(text)
        except TimeoutError:
            if scope.expired():
                raise DeadlineExceeded(
                    "the Step's deadline passed while the environment ran tool calls; the next Step runs them again"
                ) from None
            log.error("environment %r: a tool timed out; its tool loop stops", self.name)
            self._failed(TimeoutError("a tool timed out"))
            return None
        except ToolError as exc:  # environments other than ToolEnvironment may let one through
            message = Message(role="tool", content=f"error ({exc.kind}): {exc.message}", name="tool_call")
            decision = LoopDecision((message,), True, False, None, "tool_call", 0)
        except Exception as exc:
            log.exception("environment %r failed on a turn; its tool loop stops", self.name)
            self._failed(exc)
            return None
        self.pending = None
        if not decision.should_continue:
            self.truncated = decision.truncated
            self.stop(decision.reason)
        elif self.loop.turns >= self.max_turns:
            self.stop("max_turns")
        return decision

    def _failed(self, exc: BaseException) -> None:
        self.pending = None
        detail = exc.message if isinstance(exc, PrimeRLError) else str(exc)
        self.stop("env_error", f"{type(exc).__name__}: {detail}"[:500])

    def outcome(self, turns: int) -> EnvOutcome:
        return EnvOutcome(
            done=self.loop.done,
            reward=self.loop.reward if self.loop.done else None,
            reason=self.stopped,
            tool_calls=self.loop.tool_calls,
            turns=turns,
            truncated=self.truncated,
            error=self.error,
        )

    def metadata(self) -> dict[str, str]:
        """What the trajectory records about the environment episode."""
        meta = {
            "env.name": self.name,
            "env.task_id": self.task_id,
            "env.reason": self.stopped or "open",
            "env.tool_calls": str(self.loop.tool_calls),
            "env.turns": str(self.loop.turns),
            "env.done": str(self.loop.done).lower(),
            "env.truncated": str(self.truncated).lower(),
        }
        if self.loop.done and self.loop.reward is not None:
            meta["env.reward"] = repr(float(self.loop.reward))
        if self.error:
            meta["env.error"] = self.error
        return meta

    async def close(self) -> None:
        """Close the environment once; failures are logged, never raised."""
        if self.closed:
            return
        self.closed = True
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.env.close()
        except Exception:
            log.exception("closing environment %r (task %r) failed", self.name, self.task_id)


def check_env_name(name: str) -> None:
    known = env_names()
    if name not in known:
        raise InvalidArgument(f"unknown environment {name!r}; known environments: {', '.join(known)}")


async def open_env_sessions(
    name: str, config: EnvHubConfig, count: int, task_id: str | None, seed: int | None
) -> list[EnvSession]:
    """``count`` sessions of environment ``name`` on one task (a GRPO group shares its prompt).

    Errors: ``InvalidArgument`` (an unknown name or task) as raised; anything else (missing data files,
    an unreachable database, a broken factory) as FAILED_PRECONDITION naming the environment.
    """
    check_env_name(name)
    # A backstop: envhub.loop already ends within max_tool_calls + 1 turns (malformed calls count toward it).
    max_turns = 2 * (config.loop.max_tool_calls + 1)
    sessions: list[EnvSession] = []
    try:
        for _ in range(count):
            episode = await start_env_episode(name, config, task_id=task_id, seed=seed)
            sessions.append(EnvSession(name, episode, max_turns))
            task_id = episode.opening.task_id  # the other members get the first member's task
    except BaseException as exc:
        await close_all(sessions)
        if isinstance(exc, InvalidArgument) or not isinstance(exc, Exception):
            raise
        log.exception("environment %r could not be started", name)
        detail = exc.message if isinstance(exc, PrimeRLError) else str(exc)
        raise FailedPrecondition(
            f"environment {name!r} could not be started: {type(exc).__name__}: {detail}"[:1000]
        ) from None
    return sessions


async def close_all(sessions: list[EnvSession]) -> None:
    for s in sessions:
        await s.close()
