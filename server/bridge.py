"""The bridge's business logic: episodes, turns and trajectories over typed objects.

The gRPC layer (``server.service``) converts protobuf to these calls and back; everything
here is testable without sockets. Data flow of one turn: validate everything first (nothing
is written for a bad request) -> route the turn to a replica (``server.routing``) -> mark the
episode busy -> append the observation -> stream the engine's tokens into the episode as they
arrive -> close the turn (always, also on cancel, deadline or engine failure, with finish reason
ABORT and the partial tokens kept) -> report what the engine now holds to the routing index.

Episodes started with ``env`` run the env hub's tool loop server-side (``server.envsession``):
one Step samples a turn, lets the environment handle it, and while the loop continues appends
its tool results as env tokens (loss mask 0, streamed to the client in order) and samples the
next turn. Every turn is a ``Turn`` of its own, closed like any other; the Step's deadline
covers the whole loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from cache import CacheConfig
from engines.base import Engine
from engines.types import (
    FinishReason,
    GenerateRequest,
    Message,
    Origin,
    SamplingParams,
    TokenChunk,
    Usage,
    WeightUpdate,
    check_token_ids,
)
from envhub.config import EnvHubConfig
from observability.metrics import BridgeMetrics
from placement.policies import Decision, RouteRequest, RoutingConfig
from server.calls import (
    EndRequest,
    EndResult,
    StartRequest,
    StartResult,
    StepRequest,
    StepUpdate,
)
from server.config import AdmissionConfig, SamplingDefaults
from server.envsession import EnvSession, check_env_name, close_all, open_env_sessions
from server.episodes import NAN, Episode, EpisodeStore, Turn
from server.errors import (
    DeadlineExceeded,
    EngineError,
    EpisodeBusy,
    InvalidArgument,
    ResourceExhausted,
    Unimplemented,
)
from server.persistence import EpisodeJournal, PersistenceUnavailable
from server.routing import Router
from speculation.config import SpeculationConfig
from speculation.factory import SpeculationFactory, record_masked_positions

log = logging.getLogger("primerl.server")
MAX_POLICY_VERSION = 2**63 - 1
VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Bridge:
    """Episodes over a set of engine replicas serving one model."""

    def __init__(
        self,
        engines: Sequence[Engine],
        admission: AdmissionConfig,
        defaults: SamplingDefaults,
        metrics: BridgeMetrics | None = None,
        envhub: EnvHubConfig | None = None,
        journal: EpisodeJournal | None = None,
        cache: CacheConfig | None = None,
        routing: RoutingConfig | None = None,
        redis_url: str = "",
        speculation: SpeculationConfig | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a bridge needs at least one engine replica")
        self.engines = list(engines)
        self.info = self.engines[0].info
        self.tokenizer = self.engines[0].tokenizer
        self.admission = admission
        self.defaults = SamplingParams(
            temperature=defaults.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            max_tokens=min(defaults.max_tokens, admission.max_tokens_per_turn),
        )
        self.store = EpisodeStore(admission.max_episodes)
        # Routing: each turn goes where its prefix is cached (server.routing), sticky per episode, a GRPO
        # group on one replica; failed replicas are out of rotation.
        self.router = Router(self.engines, cache or CacheConfig(), routing or RoutingConfig(), redis_url)
        self._inflight: dict[str, int] = {}  # tenant -> Steps running
        # Speculation (off by default): a drafter per turn for episodes with tools; engines verify exactly.
        self.speculation: SpeculationFactory | None = None
        if speculation is not None and speculation.enabled:
            unable = [e.info.replica for e in self.engines if not e.info.supports_constraints]
            if speculation.mode == "constrained" and unable:  # they would silently decode unconstrained
                raise InvalidArgument(
                    f"speculation.mode 'constrained' needs an engine that decodes under a grammar mask "
                    f"(embedded); replicas {unable} ({self.info.engine}) cannot: use mode 'draft-only'"
                )
            self.speculation = SpeculationFactory(speculation, getattr(self.tokenizer, "hf_tokenizer", None))
        self._group_ids = itertools.count()
        self.metrics = metrics if metrics is not None else BridgeMetrics()
        self.envhub = envhub or EnvHubConfig()
        self._envs: dict[str, EnvSession] = {}  # episode id -> its environment (episodes started with env)
        self._weights_lock = asyncio.Lock()  # one UpdateWeights at a time, so versions only move forward
        self.journal = journal  # episode persistence (None: episodes live in this process only)

    @property
    def policy_version(self) -> int:
        return max(e.policy_version for e in self.engines)

    @staticmethod
    def _group_key(tenant: str, group_id: str) -> str:
        """Group ids are the client's, so they are scoped by tenant wherever they key shared state."""
        return f"{tenant}/{group_id}"

    async def start(self) -> None:
        """Start background work (the shared load board of a Redis index)."""
        self.router.start()

    def _salt(self, tenant: str, model: str) -> str:
        """Salt of prefix-cache keys: per tenant and per policy version (stale KV is never matched)."""
        return f"{tenant}/{model}@{self.policy_version}"

    def mark_replica(self, replica: int, healthy: bool, reason: str = "") -> None:
        """Take a replica out of rotation (a call failed, a health check did) or bring it back."""
        self.router.mark(replica, healthy, reason)

    async def _route_turn(self, episode: Episode, observation: Sequence[int], est_new: int) -> None:
        """Route the episode's next turn (it may move to another replica: server.routing)."""
        salt = self._salt(episode.tenant, episode.model)
        group = self._group_key(episode.tenant, episode.group_id) if episode.shares_prompt else ""
        await self.router.route(episode, observation, est_new, salt, group)

    async def _forget(self, episode: Episode) -> None:
        """Drop an ended episode's routing state (and its group's, with its last member)."""
        await self.router.forget(episode.id, self._group_key(episode.tenant, episode.group_id))

    # -- validation ---------------------------------------------------------------------

    def _check_model(self, model: str) -> str:
        if model and model != self.info.model:
            raise InvalidArgument(f"unknown model {model!r}; this bridge serves {self.info.model!r}")
        return self.info.model

    def _check_sampling(self, params: SamplingParams) -> None:
        params.validate(self.info.vocab_size)
        if params.max_tokens > self.admission.max_tokens_per_turn:
            raise InvalidArgument(
                f"sampling.max_tokens = {params.max_tokens} exceeds the limit of "
                f"{self.admission.max_tokens_per_turn} tokens per turn"
            )
        if params.max_tokens >= self.info.max_model_len:
            raise InvalidArgument(
                f"sampling.max_tokens = {params.max_tokens} does not fit the context window of "
                f"{self.info.max_model_len} tokens"
            )

    def _render(self, messages: Sequence[Message], history: Sequence[int] | None, tools: Sequence[str]) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument(f"engine {self.info.engine!r} has no tokenizer: send token ids, not messages")
        for i, m in enumerate(messages):
            if m.role not in VALID_ROLES:
                raise InvalidArgument(f"messages[{i}].role = {m.role!r}; expected one of {sorted(VALID_ROLES)}")
        if history is None:
            return self.tokenizer.render_prompt(messages, tools)
        return self.tokenizer.render_continuation(messages, history)

    def _check_length(self, total: int, what: str) -> None:
        if total >= self.info.max_model_len:
            raise InvalidArgument(
                f"{what} of {total} tokens leaves no room in the context window of {self.info.max_model_len} tokens"
            )
        if total >= self.admission.max_tokens_per_episode:
            raise ResourceExhausted(
                f"{what} of {total} tokens reaches the limit of {self.admission.max_tokens_per_episode} "
                "tokens per episode"
            )

    # -- RPCs ---------------------------------------------------------------------------

    async def start_episode(self, req: StartRequest) -> StartResult:
        model = self._check_model(req.model)
        if not 1 <= req.group_size <= self.admission.max_group_size:
            raise InvalidArgument(f"group_size must be in [1, {self.admission.max_group_size}], got {req.group_size}")
        params = req.sampling.apply(self.defaults)
        self._check_sampling(params)
        if req.env:
            return await self._start_env_episodes(req, model, params)
        if req.prompt_messages is not None:
            if not req.prompt_messages:
                raise InvalidArgument("prompt_messages is empty: send at least one message")
            prompt = self._render(req.prompt_messages, None, req.tool_schemas)
        elif req.prompt_ids:
            prompt = list(req.prompt_ids)
            check_token_ids(prompt, self.info.vocab_size, "prompt_token_ids")
        else:
            raise InvalidArgument("the prompt is empty: set prompt_token_ids or prompt_messages")
        self._check_length(len(prompt), "the prompt")
        self.store.admit(req.group_size, req.tenant, self.admission.max_episodes_per_tenant)
        result = await self._add_episodes(req, model, params, prompt)
        if self.journal is not None:
            try:
                for episode_id in result.episode_ids:
                    episode = self.store.peek(episode_id)
                    assert episode is not None
                    await self._save(episode)
            except PersistenceUnavailable:  # required and not written: the start did not happen
                for episode_id in result.episode_ids:
                    if (episode := self.store.discard(episode_id)) is not None:
                        await self._forget(episode)
                raise
        return result

    # -- persistence (server.persistence; a no-op without a journal) --------------------------------

    def _persistence_failed(self, what: str, exc: PersistenceUnavailable) -> None:
        assert self.journal is not None
        if self.journal.config.required:
            raise exc
        self.metrics.fail_open.labels("persistence").inc()
        log.warning("episode persistence failed open (%s): %s", what, exc.message)

    async def _save(self, episode: Episode) -> None:
        if self.journal is None or episode.id in self._envs:  # env sessions live in this process only
            return
        try:
            await asyncio.shield(self.journal.save(episode, episode.rev + 1))
        except PersistenceUnavailable as exc:
            self._persistence_failed("write", exc)
            return
        episode.rev += 1
        episode.persisted = True

    async def _sync(self, episode_id: str) -> None:
        """Make the local copy match the persisted record (written by this or another bridge)."""
        if self.journal is None:
            return
        local = self.store.peek(episode_id)
        try:
            remote = await self.journal.revision(episode_id)
            if remote is None:
                if local is not None and local.persisted and not local.busy and await self.journal.ended(episode_id):
                    self.store.discard(episode_id)  # ended through another bridge
                    await self._forget(local)
                elif local is not None:  # Redis lost the record (restarted empty): ours is rewritten at the turn end
                    local.persisted = False
                return
            if local is not None and local.rev >= remote:
                return
            loaded = await self.journal.load(episode_id)
        except PersistenceUnavailable as exc:
            self._persistence_failed("read", exc)
            return
        if loaded is None:
            return
        episode, rev = loaded
        episode.rev, episode.persisted = rev, True
        if episode.replica >= len(self.engines):  # written by a bridge with more replicas: routing moves it
            episode.replica = 0
        if local is None:
            self.router.opened(self._group_key(episode.tenant, episode.group_id))
        self.store.add(episode)

    async def _lease(self, episode_id: str) -> bool:
        """Hold the episode against Steps and ends on other bridges; False when persistence failed open."""
        if self.journal is None:
            return False
        try:
            if await self.journal.acquire(episode_id):
                return True
        except PersistenceUnavailable as exc:
            self._persistence_failed("lease", exc)
            return False
        raise EpisodeBusy(f"episode {episode_id!r} has a Step in progress (on this or another bridge)")

    async def _unlease(self, episode_id: str) -> None:
        if self.journal is None:
            return
        try:
            await asyncio.shield(self.journal.release(episode_id))
        except PersistenceUnavailable as exc:  # the lease expires on its own
            log.warning("could not release the lease of episode %s: %s", episode_id, exc.message)

    async def _start_env_episodes(self, req: StartRequest, model: str, params: SamplingParams) -> StartResult:
        if req.prompt_ids or req.prompt_messages is not None or req.tool_schemas:
            raise InvalidArgument(
                f"environment {req.env!r} supplies the prompt and the tool schemas: leave prompt_token_ids, "
                "prompt_messages and tool_schemas_json empty"
            )
        if self.tokenizer is None:
            raise InvalidArgument(
                f"engine {self.info.engine!r} has no tokenizer; episodes with an environment need one"
            )
        check_env_name(req.env)
        self.store.admit(req.group_size, req.tenant, self.admission.max_episodes_per_tenant)
        sessions = await open_env_sessions(req.env, self.envhub, req.group_size, req.env_task_id or None, req.env_seed)
        try:
            first = sessions[0].env
            prompt = self._render(first.prompt_messages, None, first.tool_schemas)
            self._check_length(len(prompt), "the environment's prompt")
            self.store.admit(
                req.group_size, req.tenant, self.admission.max_episodes_per_tenant
            )  # again: other episodes may have started while the envs opened
        except BaseException:
            await close_all(sessions)
            raise
        result = await self._add_episodes(req, model, params, prompt)
        self._envs.update(zip(result.episode_ids, sessions, strict=True))
        return replace(result, env_task_id=sessions[0].task_id)

    async def _add_episodes(
        self, req: StartRequest, model: str, params: SamplingParams, prompt: list[int]
    ) -> StartResult:
        group_id = req.group_id or f"grp-{uuid.uuid4().hex[:16]}"
        key = self._group_key(req.tenant, group_id)
        shared = req.group_size > 1 or bool(req.group_id)
        first_id = self.store.new_id()
        est = len(prompt) + params.max_tokens
        route = RouteRequest(
            first_id, key if shared else "", prompt, self._salt(req.tenant, model), est, first_turn=True
        )
        replica = await self.router.place(route)
        version = self.engines[replica].policy_version
        ids = []
        for i in range(req.group_size):
            member = params if params.seed is None else replace(params, seed=(params.seed + i) % 2**63)
            episode = Episode(
                id=first_id if i == 0 else self.store.new_id(),
                tenant=req.tenant,
                model=model,
                group_id=group_id,
                group_index=i,
                replica=replica,
                sampling=member,
                metadata=dict(req.metadata),
                shares_prompt=shared,
                tool_schemas=tuple(req.tool_schemas),
            )
            episode.append_unsampled(prompt, Origin.PROMPT, version)
            episode.prompt_length = len(prompt)
            self.store.add(episode)
            ids.append(episode.id)
        self.router.opened(key, req.group_size)
        return StartResult(ids, group_id, version, self.info.engine, self.engines[replica].info.replica, len(prompt))

    def step(self, req: StepRequest) -> AsyncIterator[StepUpdate]:
        """Run one turn; yields the tokens as they are appended, the last update has ``turn``.

        With persistence the Step holds the episode's lease, starts from the newest persisted
        record, and writes the record back once its turn is closed (also when it failed).
        """
        if self.journal is None:
            return self._step(req)  # nothing to hold or write back: one async-generator layer fewer per Step
        return self._persisted_step(req)

    async def _persisted_step(self, req: StepRequest) -> AsyncIterator[StepUpdate]:
        leased = await self._lease(req.episode_id)
        try:
            await self._sync(req.episode_id)
            episode = self.store.get(req.episode_id, req.tenant)
            turns = len(episode.turns)
            final: StepUpdate | None = None
            inner = self._step(req)
            try:
                async for update in inner:
                    if update.turn is not None and update.last:
                        final = update  # held back until the record is written and the lease released,
                        break  # so a client that saw the turn end can at once step or end it anywhere
                    yield update
            finally:
                await inner.aclose()  # the turn is closed and the episode idle once this returns
                if len(episode.turns) != turns:  # the Step opened a turn (closed by now, whatever happened)
                    await self._save(episode)
                if leased:
                    leased = False
                    await self._unlease(req.episode_id)
            if final is not None:
                yield final
        finally:
            if leased:
                await self._unlease(req.episode_id)

    def _admit_step(self, tenant: str) -> None:
        total = sum(self._inflight.values())
        if total >= self.admission.max_inflight_steps:
            raise ResourceExhausted(
                f"{total} Steps are running, the limit of admission.max_inflight_steps; retry shortly",
                retry_after_s=0.1,
            )
        limit = self.admission.max_inflight_steps_per_tenant
        if limit and self._inflight.get(tenant, 0) >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {limit} Steps running, its limit; retry shortly", retry_after_s=0.1
            )

    async def _step(self, req: StepRequest) -> AsyncGenerator[StepUpdate, None]:
        self._admit_step(req.tenant)
        self._inflight[req.tenant] = self._inflight.get(req.tenant, 0) + 1
        try:
            async for update in self._run_step(req):
                yield update
        finally:
            left = self._inflight[req.tenant] - 1
            if left:
                self._inflight[req.tenant] = left
            else:
                del self._inflight[req.tenant]

    async def _run_step(self, req: StepRequest) -> AsyncGenerator[StepUpdate, None]:
        episode = self.store.get(req.episode_id, req.tenant)
        if episode.busy:
            raise EpisodeBusy(f"episode {episode.id!r} already has a Step in progress; wait for it to finish")
        params = req.sampling.apply(episode.sampling)
        self._check_sampling(params)
        session = self._envs.get(episode.id)
        if session is not None:
            session.check_steppable(episode.id)
            if req.observation_ids or req.observation_messages:
                raise InvalidArgument(
                    f"episode {episode.id!r} runs environment {session.name!r}, which supplies its observations: "
                    "send no observation"
                )
            self._check_length(len(episode.token_ids), "the episode history")
            deadline = None if req.deadline_s is None else asyncio.get_running_loop().time() + req.deadline_s
            episode.busy = True
            try:
                await self._route_turn(episode, (), params.max_tokens)
                yield StepUpdate((), (), ())  # validated: the call is accepted
                async for update in self._env_loop(episode, session, params, req, deadline):
                    yield update
            finally:
                episode.busy = False
            return
        if req.observation_messages:
            observation = self._render(req.observation_messages, episode.token_ids, ())
        else:
            observation = list(req.observation_ids or ())
            check_token_ids(observation, self.info.vocab_size, "observation_token_ids")
        total = len(episode.token_ids) + len(observation)
        self._check_length(total, "the episode history")
        deadline = None if req.deadline_s is None else asyncio.get_running_loop().time() + req.deadline_s

        # Validated: from here on the episode changes, and the turn is always closed.
        episode.busy = True
        try:
            await self._route_turn(episode, observation, params.max_tokens)
            turn, turn_params = self._open_turn(episode, observation, params, req)
            yield StepUpdate((), (), ())  # validated and recorded: the call is accepted
            async for update in self._generate(episode, turn, turn_params, deadline):
                yield update
        finally:
            episode.busy = False

    def _open_turn(
        self, episode: Episode, observation: list[int], params: SamplingParams, req: StepRequest
    ) -> tuple[Turn, SamplingParams]:
        """Append the observation and open the next turn; returns it with its sampling parameters."""
        total = len(episode.token_ids) + len(observation)
        budget = min(
            params.max_tokens,
            self.info.max_model_len - total,
            self.admission.max_tokens_per_episode - total,
        )
        seed = params.seed
        if seed is not None and req.sampling.seed is None:
            # An episode-level seed covers the whole episode: turn t samples with seed + t * 7919
            # (a per-turn override is used as given).
            seed = (seed + len(episode.turns) * 7919) % 2**63
        version = self.engines[episode.replica].policy_version
        episode.append_unsampled(observation, Origin.ENV, version)
        turn = Turn(
            index=len(episode.turns),
            observation_start=total - len(observation),
            generation_start=total,
            end=total,
            policy_version=version,
        )
        episode.turns.append(turn)
        return turn, replace(params, max_tokens=budget, seed=seed)

    def _has_room(self, episode: Episode, extra: int) -> bool:
        """Whether ``extra`` more tokens still leave room to sample at least one."""
        total = len(episode.token_ids) + extra
        return total < self.info.max_model_len and total < self.admission.max_tokens_per_episode

    async def _env_loop(
        self, episode: Episode, session: EnvSession, params: SamplingParams, req: StepRequest, deadline: float | None
    ) -> AsyncIterator[StepUpdate]:
        """Sample turns and run their tool calls until the environment's loop stops or a bound is hit."""
        assert self.tokenizer is not None  # checked at StartEpisode
        turns = 0
        observation: list[int] = []
        text = session.pending  # tool calls an interrupted Step left unrun go first
        # A turn cut short (cancel, deadline) is continued by the next one: the loop reads them as one message.
        last = episode.turns[-1] if episode.turns else None
        start = last.generation_start if text is None and last and last.finish_reason == FinishReason.ABORT else None
        while True:
            if text is None:
                turn, turn_params = self._open_turn(episode, observation, params, req)
                if observation:
                    n = len(observation)
                    yield StepUpdate(tuple(observation), (NAN,) * n, (Origin.ENV,) * n)
                async for update in self._generate(episode, turn, turn_params, deadline):
                    yield update if update.turn is None else replace(update, last=False)
                turns += 1
                if turn.finish_reason == FinishReason.ABORT:  # the engine aborted it: the next Step continues it
                    break
                text = self.tokenizer.decode(
                    episode.token_ids[turn.generation_start if start is None else start : turn.end]
                )
                start = None
            decision = await session.run_turn(text, deadline)
            text = None
            if decision is None or session.stopped:
                break
            try:
                observation = self.tokenizer.render_continuation(decision.observation, episode.token_ids)
            except InvalidArgument as exc:
                session.stop("env_error", exc.message)
                break
            if not self._has_room(episode, len(observation)):
                session.stop("context_exhausted")
                break
        outcome = session.outcome(turns)
        if outcome.reason == "" and turns and episode.turns[-1].finish_reason == FinishReason.ABORT:
            outcome = replace(outcome, reason="aborted")
        yield StepUpdate((), (), (), episode.turns[-1], last=True, env=outcome)

    async def _generate(
        self, episode: Episode, turn: Turn, params: SamplingParams, deadline: float | None
    ) -> AsyncIterator[StepUpdate]:
        engine = self.engines[episode.replica]
        request = GenerateRequest(
            request_id=uuid.uuid4().hex,
            token_ids=tuple(episode.token_ids),
            params=params,
            episode_id=episode.id,
            group_id=self._group_key(episode.tenant, episode.group_id) if episode.shares_prompt else "",
            # Salted per tenant too: cached-token counts must not reveal another tenant's prompts.
            cache_salt=f"{episode.tenant}/{episode.model}@{turn.policy_version}",
            drafter=self._drafter(episode),
            constraint=self._constraint(episode),
        )
        route = self.router.current(episode)  # reported to the index when the turn ends
        matched = route[0].matched_tokens if route is not None else 0
        load = len(request.token_ids) - matched + params.max_tokens  # in-flight work: uncached prefill + decode
        replica = episode.replica
        self.router.begin(replica, load)
        last: TokenChunk | None = None
        stream = engine.generate(request)
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in stream:
                    last = chunk
                    origins = chunk.origins_or_sampled()
                    if chunk.token_ids:
                        if turn.ttft_ms == 0.0:
                            turn.ttft_ms = (time.perf_counter() - turn.started) * 1e3
                        episode.append(
                            chunk.token_ids, chunk.logprobs, origins, chunk.policy_version, chunk.raw_logprobs
                        )
                        turn.end = len(episode.token_ids)
                        turn.policy_version = chunk.policy_version
                    raw = chunk.raw_logprobs
                    if chunk.finish_reason is None:
                        yield StepUpdate(chunk.token_ids, chunk.logprobs, origins, None, raw)
                    else:
                        self._close(turn, chunk.finish_reason, chunk.usage)
                        if request.constraint is not None:  # the mask replay handle, before the last update
                            record_masked_positions(episode.metadata, request.constraint, len(episode.token_ids))
                        yield StepUpdate(chunk.token_ids, chunk.logprobs, origins, turn, raw)
                        return
            raise EngineError(f"engine {engine.info.replica!r} ended the stream without a finish reason")
        except EngineError as exc:
            self.mark_replica(episode.replica, False, exc.message)
            raise
        except TimeoutError:
            raise DeadlineExceeded(
                f"the turn did not finish before its deadline; {turn.end - turn.generation_start} partial "
                "tokens are kept in the episode"
            ) from None
        finally:
            self.router.end(replica, load)
            if request.constraint is not None:  # (again on the normal path: the merge is idempotent)
                record_masked_positions(episode.metadata, request.constraint, len(episode.token_ids))
            if turn.finish_reason is None:  # cancelled, timed out or failed: keep what we have
                self._close(turn, FinishReason.ABORT, last.usage if last else None)
                await asyncio.shield(engine.abort(request.request_id))
            await stream.aclose()
            if route is not None and self.router.index is not None:
                await asyncio.shield(self._report(episode, turn, route))

    def _tool_grammar(self, episode: Episode) -> tuple[bool, Any]:
        """(has tools, the env's grammar or None): speculation targets tool-call spans only."""
        session = self._envs.get(episode.id)
        grammar = session.env.grammar if session is not None else None
        return bool(episode.tool_schemas) or grammar is not None, grammar

    def _drafter(self, episode: Episode) -> Any:
        """A speculation drafter for the episode's next turn (None: plain decoding)."""
        if self.speculation is None:
            return None
        tools, grammar = self._tool_grammar(episode)
        return self.speculation.drafter(episode.tool_schemas, grammar) if tools else None

    def _constraint(self, episode: Episode) -> Any:
        """Constrained mode: the grammar mask for the episode's next turn (None: unconstrained)."""
        if self.speculation is None:
            return None
        tools, grammar = self._tool_grammar(episode)
        return self.speculation.constraint(episode.tool_schemas, grammar) if tools else None

    async def _report(self, episode: Episode, turn: Turn, route: tuple[Decision, str]) -> None:
        """Tell the routing index what the engine now holds, and count what routing predicted."""
        predicted = await self.router.report(episode, turn, route)
        self.metrics.observe_index_lookup(self.info.model, turn.generation_start, predicted)

    def _close(self, turn: Turn, finish: FinishReason, usage: Usage | None) -> None:
        turn.finish_reason = finish
        turn.usage = usage or Usage(
            prompt_tokens=turn.generation_start, generated_tokens=turn.end - turn.generation_start
        )
        turn.latency_ms = (time.perf_counter() - turn.started) * 1e3
        latency_s, ttft_s = turn.latency_ms / 1e3, turn.ttft_ms / 1e3
        self.metrics.observe_turn(self.info.model, self.info.engine, finish.name.lower(), turn.usage, latency_s, ttft_s)

    async def end_episode(self, req: EndRequest) -> EndResult:
        leased = await self._lease(req.episode_id)
        try:
            await self._sync(req.episode_id)
            return await self._end_episode(req)
        finally:
            if leased:
                await self._unlease(req.episode_id)

    async def _end_episode(self, req: EndRequest) -> EndResult:
        episode = self.store.get(req.episode_id, req.tenant)
        if episode.busy:
            raise EpisodeBusy(f"episode {episode.id!r} has a Step in progress; end it after the Step finishes")
        for i, r in enumerate(req.rewards):
            if not math.isfinite(r):
                raise InvalidArgument(f"rewards[{i}] = {r} is not a finite number")
        if req.turn_rewards:
            if len(req.turn_rewards) != len(episode.turns):
                raise InvalidArgument(
                    f"turn_rewards has {len(req.turn_rewards)} entries but the episode has {len(episode.turns)} turns"
                )
            for i, r in enumerate(req.turn_rewards):
                if not math.isfinite(r):
                    raise InvalidArgument(f"turn_rewards[{i}] = {r} is not a finite number")
        if self.journal is not None and episode.persisted:
            try:  # first, so that a failure changes nothing here and the client can simply retry
                await self.journal.delete(episode.id)
            except PersistenceUnavailable as exc:
                self._persistence_failed("delete", exc)
        self.store.pop(episode.id, req.tenant)
        await self._forget(episode)
        rewards = req.rewards
        if (session := self._envs.pop(episode.id, None)) is not None:
            await session.close()
            episode.metadata.update(session.metadata())
            if not rewards and session.loop.done and session.loop.reward is not None:
                rewards = (float(session.loop.reward),)  # the grader's, unless the trainer sent its own
        await self.engines[episode.replica].release(episode.id)
        duration = (time.perf_counter() - episode.created) * 1e3
        return EndResult(episode, rewards, req.turn_rewards, duration)

    async def close(self) -> None:
        """Close the environments of episodes still open (at shutdown, after in-flight Steps drained)."""
        sessions, self._envs = list(self._envs.values()), {}
        await close_all(sessions)
        await self.router.close()

    async def update_weights(self, checkpoint_path: str, policy_version: int, keep_kv: bool, model: str = "") -> int:
        self._check_model(model)
        current = self.policy_version
        version = policy_version or current + 1
        if version > MAX_POLICY_VERSION:
            raise InvalidArgument(f"policy_version must be at most {MAX_POLICY_VERSION} (int64), got {version}")
        if version <= current:
            raise InvalidArgument(f"policy_version {version} must be greater than the current version {current}")
        if not self.info.supports_weight_updates:
            raise Unimplemented(f"engine {self.info.engine!r} cannot load new weights at run time")
        update = WeightUpdate(checkpoint_path=checkpoint_path, policy_version=version, keep_kv=keep_kv)
        async with self._weights_lock:
            if version <= self.policy_version:  # another update landed while this one waited
                raise InvalidArgument(
                    f"policy_version {version} must be greater than the current version {self.policy_version}"
                )
            done: list[str] = []
            for i, engine in enumerate(self.engines):
                try:
                    await engine.update_weights(update)
                except EngineError as exc:
                    # Replicas must not serve mixed versions: this one leaves rotation until it is updated.
                    self.mark_replica(i, False, f"weight update to version {version} failed: {exc.message}")
                    if not done:
                        raise
                    raise EngineError(
                        f"weights updated to version {version} on {done} but failed on {engine.info.replica!r} "
                        f"({exc.message}); it is out of rotation until an update reaches it"
                    ) from None
                done.append(engine.info.replica)
        return version
