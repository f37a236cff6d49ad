"""One turn of an episode: open it, stream the engine's tokens into the episode, close it.

Invariants:
- a turn opened is always closed (``generate``'s ``finally``, or ``close`` for a turn whose stream
  never started): on cancel, deadline or engine failure its finish reason is ABORT, its partial
  tokens stay in the episode and the engine is told to abort;
- tokens are appended as they stream, with logprob, origin and the policy version of the weights
  that produced them (on a LoRA adapter: the adapter version the turn holds from open to close);
- the engine's report (cached tokens, the blocks it now holds) confirms or drops what routing
  recorded, once the turn is closed;
- a GRPO group's first turns on an engine without ``Capability.GROUP_PREFILL``: the first member to arrive
  goes ahead, the others wait until its first token (its prompt is then in the engine's prefix cache), so
  the shared prompt is prefilled once, not once per member scheduled in the same engine step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from core.salt import salt_text
from core.types import Capability, FinishReason, GenerateRequest, Origin, SamplingParams, TokenChunk, Usage
from engines.base import Engine
from observability.metrics import BridgeMetrics
from server.calls import StepUpdate
from server.episodes import Episode, Turn
from server.errors import DeadlineExceeded, EngineError
from server.requestid import engine_request_id
from speculation.factory import SpeculationFactory, record_masked_positions

if TYPE_CHECKING:
    from server.adapters import Adapters

SEED_STRIDE = 7919  # an episode-level seed covers the whole episode: turn t samples with seed + t * SEED_STRIDE


class Turns:
    """Opens, streams and closes the turns of every episode of one bridge."""

    def __init__(
        self,
        engines: Sequence[Engine],
        router: Any,
        metrics: BridgeMetrics,
        speculation: SpeculationFactory | None,
        max_tokens_per_episode: int,
        adapters: Adapters | None = None,
    ) -> None:
        self.engines = engines
        self.adapters = adapters  # LoRA adapters: a turn on one holds its committed version from open to close
        self.info = engines[0].info
        self.router = router
        self.metrics = metrics
        self.speculation = speculation
        self.max_tokens_per_episode = max_tokens_per_episode
        self.live: dict[str, Engine] = {}  # request id -> the engine running it (turns streaming now)
        self._prefills: dict[tuple[str, int], asyncio.Event] = {}  # (group, replica) -> set: its prompt is prefilled

    def open(
        self,
        episode: Episode,
        observation: list[int],
        params: SamplingParams,
        step_seed: bool,
        salt: str = "",
        salt_version: int = -1,
    ) -> tuple[Turn, SamplingParams]:
        """Append the observation and open the next turn; returns it with its sampling parameters.

        ``step_seed``: the Step set its own seed, used as given (else the episode's seed is offset per turn).
        ``salt``: the salt the turn was routed with, naming ``salt_version``. The turn's engine request carries
        it when the turn runs at that version (always, except while a weight update is reaching the replicas one
        by one, when the salt is built anew for the version that runs the turn): one salt per turn.
        """
        total = len(episode.token_ids) + len(observation)
        budget = min(params.max_tokens, self.info.max_model_len - total, self.max_tokens_per_episode - total)
        seed = params.seed
        if seed is not None and not step_seed:
            seed = (seed + len(episode.turns) * SEED_STRIDE) % 2**63
        version = self.engines[episode.replica].policy_version
        adapter = self.adapters.acquire(episode.adapter) if episode.adapter and self.adapters is not None else None
        lora = adapter.served if adapter is not None else ""
        if not salt or salt_version != version or adapter is not None:  # (an adapter commit may have come between)
            # Salted per tenant too: cached-token counts must not reveal another tenant's prompts.
            salt = salt_text(episode.model, version, episode.tenant, lora)
        tokens_version = adapter.version if adapter is not None else version  # an adapter's tokens: its version
        episode.append_unsampled(observation, Origin.ENV, tokens_version)
        turn = Turn(
            index=len(episode.turns),
            observation_start=total - len(observation),
            generation_start=total,
            end=total,
            policy_version=tokens_version,
            cache_salt=salt,
            adapter=adapter,
        )
        episode.turns.append(turn)
        if budget == params.max_tokens and seed == params.seed:  # nothing to change (most turns): no copy
            return turn, params
        return turn, replace(params, max_tokens=budget, seed=seed)

    async def abort_all(self) -> int:
        """Ask the engines to abort every turn streaming now (each ends ABORT, partial tokens kept)."""
        live = list(self.live.items())
        for request_id, engine in live:
            await engine.abort(request_id)
        return len(live)

    def has_room(self, episode: Episode, extra: int) -> bool:
        """Whether ``extra`` more tokens still leave room to sample at least one."""
        total = len(episode.token_ids) + extra
        return total < self.info.max_model_len and total < self.max_tokens_per_episode

    def _request(self, episode: Episode, turn: Turn, params: SamplingParams, grammar: Any) -> GenerateRequest:
        drafter = constraint = None
        if self.speculation is not None and (episode.tool_schemas or grammar is not None):
            # Speculation targets tool-call spans only: episodes with tools (or an env's grammar).
            if Capability.DRAFT_VERIFY in self.engines[episode.replica].info.capabilities:
                drafter = self.speculation.drafter(episode.tool_schemas, grammar)
            constraint = self.speculation.constraint(episode.tool_schemas, grammar)
        return GenerateRequest(
            request_id=engine_request_id(turn.index),
            token_ids=tuple(episode.token_ids),
            params=params,
            episode_id=episode.id,
            group_id=episode.routing_group,
            cache_salt=turn.cache_salt,
            drafter=drafter,
            constraint=constraint,
            adapter=turn.adapter,
        )

    async def generate(
        self, episode: Episode, turn: Turn, params: SamplingParams, deadline: float | None, grammar: Any = None
    ) -> AsyncGenerator[StepUpdate, None]:
        """Stream one turn from the episode's replica; the last update carries the closed ``turn``."""
        engine = self.engines[episode.replica]
        request = self._request(episode, turn, params, grammar)
        route = self.router.current(episode)  # reported to the index when the turn ends
        matched = route[0].matched_tokens if route is not None else 0
        load = len(request.token_ids) - matched + params.max_tokens  # in-flight work: uncached prefill + decode
        replica = episode.replica
        wait_for, lead = self._group_gate(episode, turn, engine)
        self.router.begin(replica, load, episode.id)
        self.live[request.request_id] = engine
        last: TokenChunk | None = None
        stream = engine.generate(request)
        try:
            async with asyncio.timeout_at(deadline):
                if wait_for is not None:
                    await wait_for.wait()
                async for chunk in stream:
                    last = chunk
                    origins = chunk.origins_or_sampled()
                    if chunk.token_ids:
                        if lead is not None:
                            lead.set()
                        if turn.ttft_ms == 0.0:
                            turn.ttft_ms = (time.perf_counter() - turn.started) * 1e3
                        # An adapter's tokens carry its version (the engine reports the base weights').
                        version = chunk.policy_version if turn.adapter is None else turn.adapter.version
                        episode.append(
                            chunk.token_ids, chunk.logprobs, origins, version, chunk.raw_logprobs, chunk.kept_logmass
                        )
                        turn.end = len(episode.token_ids)
                        turn.policy_version = version
                    raw, kept = chunk.raw_logprobs, chunk.kept_logmass
                    if chunk.finish_reason is None:
                        yield StepUpdate(chunk.token_ids, chunk.logprobs, origins, None, raw, kept_logmass=kept)
                    else:
                        self.close(turn, chunk.finish_reason, chunk.usage)
                        if request.constraint is not None:  # the mask replay handle, before the last update
                            record_masked_positions(episode.metadata, request.constraint, len(episode.token_ids))
                        yield StepUpdate(chunk.token_ids, chunk.logprobs, origins, turn, raw, kept_logmass=kept)
                        return
            raise EngineError(f"engine {engine.info.replica!r} ended the stream without a finish reason")
        except EngineError as exc:
            self.router.mark(episode.replica, False, exc.message)
            raise
        except TimeoutError:
            raise DeadlineExceeded(
                f"the turn did not finish before its deadline; {turn.end - turn.generation_start} partial "
                "tokens are kept in the episode"
            ) from None
        finally:
            if lead is not None:
                lead.set()
                self._prefills.pop((episode.routing_group, replica), None)
            self.router.end(replica, load)
            del self.live[request.request_id]
            if request.constraint is not None:  # (again on the normal path: the merge is idempotent)
                record_masked_positions(episode.metadata, request.constraint, len(episode.token_ids))
            if turn.finish_reason is None:  # cancelled, timed out or failed: keep what we have
                try:  # the engine stops first: the turn's adapter version is let go (``close``) only then
                    await asyncio.shield(engine.abort(request.request_id))
                finally:
                    self.close(turn, FinishReason.ABORT, last.usage if last else None)
            await stream.aclose()
            if route is not None and self.router.index is not None:
                await asyncio.shield(self._report(episode, turn, route))

    def _group_gate(
        self, episode: Episode, turn: Turn, engine: Engine
    ) -> tuple[asyncio.Event | None, asyncio.Event | None]:
        """A GRPO group's prefill gate on ``engine`` for this turn (see module docstring): (the gate to wait for,
        None) for a member behind the first; (None, the gate to open at the first token) for the first one;
        (None, None) when no gate applies."""
        if turn.index or not episode.shares_prompt or Capability.GROUP_PREFILL in engine.info.capabilities:
            return None, None
        key = (episode.routing_group, episode.replica)
        gate = self._prefills.get(key)
        if gate is not None:
            return gate, None
        gate = self._prefills[key] = asyncio.Event()
        return None, gate

    async def _report(self, episode: Episode, turn: Turn, route: Any) -> None:
        """Tell the routing index what the engine now holds, and count what routing predicted."""
        predicted = await self.router.report(episode, turn, route)
        self.metrics.observe_index_lookup(self.info.model, turn.generation_start, predicted)

    def close(self, turn: Turn, finish: FinishReason, usage: Usage | None) -> None:
        """Record a turn's outcome (idempotent: a closed turn stays as it was closed)."""
        if turn.finish_reason is not None:
            return
        turn.finish_reason = finish
        if turn.adapter is not None and self.adapters is not None:
            self.adapters.release(turn.adapter)
        turn.usage = usage or Usage(
            prompt_tokens=turn.generation_start, generated_tokens=turn.end - turn.generation_start
        )
        turn.latency_ms = (time.perf_counter() - turn.started) * 1e3
        latency_s, ttft_s = turn.latency_ms / 1e3, turn.ttft_ms / 1e3
        self.metrics.observe_turn(self.info.model, self.info.engine, finish.name.lower(), turn.usage, latency_s, ttft_s)
