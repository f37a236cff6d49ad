"""One HTTP generation call on a session, through the bridge's one Step path.

A call is planned on its session, then driven exactly as gRPC ``Step`` drives a Step:
``Bridge.start_episode`` (the session's first call, or a fork) and ``Bridge.prepare_step`` per episode,
then ``handle.updates()`` streamed into the choice, and ``handle.close()`` always. Nothing here samples,
renders a history or appends a token itself: the bridge does, so HTTP and gRPC episodes are the same.

Planning (``Runner.begin``):
- first call: a new episode (a GRPO group of ``n`` with one prompt prefill, one member session each);
- token ids that extend the episode's ids: the new ids are the observation (origin ``env``);
- chat messages that extend the session's recorded messages (the produced assistant turns included):
  only the new messages are rendered (``Tokenizer.render_continuation``) and appended;
- anything else is a fork: a new episode (branch) from the request's history, counted in
  ``primerl_http_forks`` and in the episode's metadata ``http.forks``; the old branch is kept, never spliced.

Driving (``Runner.run``): the choices' Steps run concurrently, a group's members each under its own request
id (``<id>.<index>``: engine request ids derive from it and must be unique among running requests); a stop
string ends a choice's Step early (its turn closes as ABORT with the tokens sampled so far, the visible text
ends before the match; each update decodes only its new tokens to look for one: ``server.http.stops``). The
call's session is released when every Step is closed, whatever happened (error, disconnect, cancel).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.responses import StreamingResponse

from core.errors import PrimeRLError
from core.types import NO_OVERRIDES, FinishReason, SamplingOverrides
from observability.metrics import BridgeMetrics
from server.bridge import Bridge
from server.calls import StartRequest, StepRequest
from server.episodes import Turn
from server.http.errors import BadParam
from server.http.models import ChatMessage
from server.http.render import canonical, engine_messages
from server.http.sessions import Session, SessionRegistry
from server.http.sse import Chunks, stream
from server.http.stops import StopScanner
from server.requestid import current_request_id
from server.steps import StepHandle

log = logging.getLogger("primerl.server.http")

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclass(frozen=True)
class Call:
    """What one HTTP call asks of its session."""

    route: str
    sampling: SamplingOverrides = NO_OVERRIDES
    n: int = 1
    ids: list[int] | None = None  # a token prompt (token route, completions)
    messages: list[ChatMessage] | None = None  # a chat history
    tools: tuple[str, ...] = ()
    model: str = ""
    stops: tuple[str, ...] = ()


@dataclass(eq=False)
class Choice:
    """One choice of a call: a Step of one episode, and what it sampled."""

    index: int
    session: Session
    handle: StepHandle
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_hit: str | None = None
    text_end: int | None = None  # the visible text ends here (before a matched stop string)
    scanner: StopScanner | None = None  # the call's stop strings, scanned as the choice's tokens arrive
    error: PrimeRLError | None = None
    message: dict[str, Any] | None = None  # chat: the assistant message (set when the call finishes)

    @property
    def turn(self) -> Turn | None:
        return self.handle.turn

    @property
    def prompt_ids(self) -> list[int]:
        """The ids the engine continued (the episode's history before this turn)."""
        turn = self.turn
        return self.handle.episode.token_ids[: turn.generation_start] if turn is not None else []

    @property
    def finish_reason(self) -> str:
        if self.stop_hit is not None:
            return "stop"
        turn = self.turn
        reason = turn.finish_reason if turn is not None else None
        return FINISH.get(reason, "abort") if reason is not None else "abort"

    def usage(self) -> dict[str, Any]:
        turn = self.turn
        prompt = turn.generation_start if turn is not None else 0
        cached = turn.usage.cached_tokens if turn is not None else 0
        done = len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def total_usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """A call's usage: the shared prompt once, every choice's completion."""
    first = choices[0].usage()
    done = sum(len(c.token_ids) for c in choices)
    return first | {"completion_tokens": done, "total_tokens": first["prompt_tokens"] + done}


class Runner:
    """Plans and drives the HTTP calls of one front door (see module docstring)."""

    def __init__(self, bridge: Bridge, registry: SessionRegistry, metrics: BridgeMetrics) -> None:
        self.bridge = bridge
        self.registry = registry
        self.metrics = metrics

    # -- planning -----------------------------------------------------------------------

    async def begin(self, session: Session, call: Call) -> list[Choice]:
        """Claim the session and accept the call's Steps; raises (session released) if the call is refused."""
        if session.members:
            raise BadParam(
                "X-Session-ID",
                f"session {session.id!r} is a group of {len(session.members)}: continue each member through its "
                f"own session id ({session.members[0]!r}, ...)",
            )
        self.registry.claim(session)
        try:
            return await self._plan(session, call)
        except BaseException:
            self.registry.release(session)
            raise

    async def _plan(self, session: Session, call: Call) -> list[Choice]:
        if not session.started:
            return await self._start(session, call)
        if call.n != 1:
            raise BadParam("n", "n > 1 samples a GRPO group: only on a session's first call")
        ep = self.registry.episode(session.episode_ids[0])
        if call.messages is not None:
            recorded = session.messages
            k = len(recorded) if recorded is not None else -1
            if k < 0 or len(call.messages) <= k or canonical(call.messages[:k]) != canonical(recorded or []):
                return await self._fork(session, call, 0)
            new = engine_messages(call.messages[k:], k)
            step = StepRequest(ep.id, observation_messages=new, sampling=call.sampling, tenant=session.tenant)
        else:
            ids, history = call.ids or [], ep.token_ids
            if len(ids) < len(history) or ids[: len(history)] != history:
                common = next((i for i, (a, b) in enumerate(zip(ids, history, strict=False)) if a != b), None)
                return await self._fork(session, call, min(len(ids), len(history)) if common is None else common)
            observation = tuple(ids[len(history) :])
            step = StepRequest(ep.id, observation_ids=observation, sampling=call.sampling, tenant=session.tenant)
        return [Choice(0, session, await self.bridge.prepare_step(step))]

    async def _fork(self, session: Session, call: Call, common: int) -> list[Choice]:
        """The call does not extend the session: a new branch from its history (counted, never spliced)."""
        session.branches.append(session.episode_ids)
        session.episode_ids, session.messages = [], None
        session.forks += 1
        self.metrics.http_forks.labels(call.route).inc()
        log.info("session %r: history does not extend it; branch %d starts (%d tokens in common)",
                 session.id, session.forks, common)  # fmt: skip
        return await self._start(session, replace(call, n=1), {"http.fork_common_tokens": str(common)})

    async def _start(self, session: Session, call: Call, extra: dict[str, str] | None = None) -> list[Choice]:
        metadata = {**session.metadata, **(extra or {}), "http.session": session.id, "http.forks": str(session.forks)}
        started = await self.bridge.start_episode(
            StartRequest(
                model=call.model,
                prompt_ids=tuple(call.ids or ()) if call.messages is None else None,
                prompt_messages=engine_messages(call.messages) if call.messages is not None else None,
                tool_schemas=session.tools or call.tools,
                # The first call's sampling is the episode's: a seeded group's members get seed + i.
                sampling=SamplingOverrides({**session.sampling, **call.sampling}),
                group_size=call.n,
                metadata=metadata,
                tenant=session.tenant,
            )
        )
        session.episode_ids = list(started.episode_ids)
        sessions = [session]
        if call.n > 1:  # one member session per episode, each continued on its own
            sessions = []
            for i, ep in enumerate(started.episode_ids):
                member = await self.registry.create(
                    session.tenant, f"{session.id}.{i}", episode_ids=[ep], tools=session.tools or call.tools,
                    sampling=session.sampling, metadata=session.metadata,
                )  # fmt: skip
                member.busy = True  # released with the call
                sessions.append(member)
            session.members = [s.id for s in sessions]
        choices: list[Choice] = []
        try:
            for i, (s, ep) in enumerate(zip(sessions, started.episode_ids, strict=True)):
                handle = await self.bridge.prepare_step(StepRequest(ep, tenant=session.tenant))
                choices.append(Choice(i, s, handle))
        except BaseException:
            for c in choices:
                await c.handle.close()
            for s in sessions[1:] if call.n > 1 else ():
                self.registry.release(s)
            raise
        return choices

    # -- driving ------------------------------------------------------------------------

    async def respond(
        self,
        session: Session,
        choices: list[Choice],
        stops: Sequence[str],
        chunks: Chunks | None,
        headers: dict[str, str],
        on_done: Callable[[list[Choice]], None] | None = None,
    ) -> StreamingResponse | None:
        """Stream the call's choices as server-sent events through ``chunks``; without ``chunks``, run them to
        the end here and return None (the caller builds the JSON response)."""
        if chunks is not None:
            return stream(
                lambda queue: self.run(session, choices, stops, queue, on_done), len(choices), chunks, headers
            )
        await self.run(session, choices, stops, None, on_done)
        return None

    async def run(
        self,
        session: Session,
        choices: list[Choice],
        stops: Sequence[str] = (),
        queue: asyncio.Queue[tuple[int, int | None]] | None = None,
        on_done: Callable[[list[Choice]], None] | None = None,
    ) -> list[Choice]:
        """Drive every choice's Step to its end; ``queue`` gets (index, new tokens), and (index, None) per choice last.

        ``on_done`` records the session's state (chat: its messages) before the session is released.
        """
        try:
            rid = current_request_id.get()
            ids = [f"{rid}.{c.index}" if len(choices) > 1 and rid else None for c in choices]
            await asyncio.gather(*(self._drive(c, stops, queue, i) for c, i in zip(choices, ids, strict=True)))
            if on_done is not None and not any(c.error for c in choices):
                on_done(choices)
            return choices
        finally:
            for c in choices:
                await c.handle.close()  # idempotent; covers a cancelled gather
                if c.error is not None:
                    c.session.messages = None  # its history now ends in a partial turn: the next call forks
                if c.session is not session:
                    self.registry.release(c.session)
            self.registry.release(session)
            if queue is not None:  # after on_done: a stream's last event sees what it recorded
                for c in choices:
                    queue.put_nowait((c.index, None))

    async def _drive(
        self,
        c: Choice,
        stops: Sequence[str],
        queue: asyncio.Queue[tuple[int, int | None]] | None,
        request_id: str | None = None,
    ) -> None:
        if request_id is not None:  # this task's own context (gather runs each coroutine as a task)
            current_request_id.set(request_id)
        updates = c.handle.updates()
        try:
            async for u in updates:
                if not u.token_ids:
                    continue
                c.token_ids.extend(u.token_ids)
                c.logprobs.extend(u.logprobs)
                if stops:
                    self._match_stop(c, stops)
                if queue is not None:
                    queue.put_nowait((c.index, len(u.token_ids)))
                if c.stop_hit is not None:
                    break  # closing the Step aborts the engine request; the turn keeps what was sampled
        except PrimeRLError as exc:
            c.error = exc
        finally:
            await updates.aclose()
            await c.handle.close()

    def _match_stop(self, c: Choice, stops: Sequence[str]) -> None:
        """Decode what the update added (``StopScanner``: never the whole choice again) and look for a stop."""
        tok = self.bridge.tokenizer
        if tok is None:
            return
        if c.scanner is None:
            c.scanner = StopScanner(tok, stops)
        hit = c.scanner.scan(c.token_ids)
        if hit is not None:
            c.text_end, c.stop_hit = hit

    def text(self, c: Choice) -> str:
        """The choice's visible text (up to a matched stop string)."""
        tok = self.bridge.tokenizer
        text = tok.decode(c.token_ids) if tok is not None and c.token_ids else ""
        return text if c.text_end is None else text[: c.text_end]
