"""The bridge's business logic: episodes and their Steps over typed objects.

The gRPC layer (``server.service``) converts protobuf to these calls and back; everything here is
testable without sockets. The bridge composes the parts that each own one concern:

- ``server.admission``: limits checked before anything is accepted (in-flight Steps, staleness, length);
- ``server.journaled``: open episodes, their persisted records and cross-bridge leases;
- ``placement.routing``: which replica serves each turn, and what the prefix index learns;
- ``server.turns``: one turn (open, stream the engine into the episode, close);
- ``server.steps``: an accepted Step (``StepHandle``) and the env tool loop;
- ``server.weights``: weight updates and the policy version;
- ``server.replicas``: which replicas are in rotation, and the replica API the fleet calls (``Bridge.replicas``);
- ``server.membership`` (optional): the fleet's one policy version per model, adopted before each turn.

A Step: ``prepare_step`` validates everything first (nothing is written for a bad request), admits,
routes and opens the turn, and returns a ``StepHandle``; the caller streams ``handle.updates()`` and
always calls ``handle.close()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from cache import CacheConfig
from core.proof import WeightProof
from core.salt import salt_text
from core.types import Message, Origin, SamplingParams, check_token_ids
from engines.base import Engine
from envhub.config import EnvHubConfig
from observability.metrics import BridgeMetrics
from placement.routing import Router, RouteRequest, RoutingConfig
from server.adapters import Adapters
from server.admission import Admission
from server.calls import EndRequest, EndResult, StartRequest, StartResult, StepRequest
from server.config import AdmissionConfig, SamplingDefaults
from server.envsession import EnvSession, check_env_name, close_all, open_env_sessions
from server.episodes import Episode, EpisodeStore
from server.errors import DeadlineExceeded, EpisodeBusy, InvalidArgument
from server.inspector import EpisodeLog, InspectorConfig
from server.journaled import JournaledStore
from server.membership import FleetMembership
from server.pause import exclusive
from server.persistence import EpisodeJournal
from server.replicas import Replicas
from server.steps import StepHandle
from server.turns import Turns
from server.weights import Weights
from speculation.config import SpeculationConfig
from speculation.factory import speculation_for

log = logging.getLogger("primerl.server")
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
        inspector: EpisodeLog | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a bridge needs at least one engine replica")
        self.engines = list(engines)
        self.info = self.engines[0].info
        self.tokenizer = self.engines[0].tokenizer
        self.admission = admission
        self.metrics = metrics if metrics is not None else BridgeMetrics()
        self.admit = Admission(admission, self.info, self.metrics)
        # Server defaults < episode < step (``SamplingParams.merge``); every field may have a server default.
        self.defaults = replace(defaults, max_tokens=min(defaults.max_tokens, admission.max_tokens_per_turn))
        self.store = EpisodeStore(admission.max_episodes)
        # Routing: where the turn's prefix is cached, sticky per episode, a GRPO group on one replica, failed ones out.
        self.router = Router(self.engines, cache or CacheConfig(), routing or RoutingConfig(), redis_url)
        self.speculation = speculation_for(speculation, [e.info for e in self.engines], self.tokenizer)
        self.inspector = inspector if inspector is not None else EpisodeLog(InspectorConfig())  # the live inspector
        phase = self.metrics.weight_update_phase
        self.weights = Weights(self.engines, self.mark_replica, self.inspector.weights_updated, phase)
        self.adapters = Adapters(self.engines, self.weights, phase, self.router.replicas.ok)  # LoRA, own versions
        self.turns = Turns(
            self.engines, self.router, self.metrics, self.speculation, admission.max_tokens_per_episode, self.adapters
        )
        self.replicas = Replicas(self.engines, self.router, self.turns, self.weights)  # the fleet's replica API
        self._serving = asyncio.Event()  # cleared by pause(): new Steps wait for resume()
        self._serving.set()
        self.envhub = envhub or EnvHubConfig()
        self._envs: dict[str, EnvSession] = {}  # episode id -> its environment (episodes started with env)
        self.journal = journal  # episode persistence (None: episodes live in this process only)
        self.fleet: FleetMembership | None = None  # fleet membership (attach_fleet); None: its own version
        self.episodes = JournaledStore(
            self.store,
            journal,
            self.metrics,
            len(self.engines),
            local_only=self._envs.__contains__,  # env sessions live in this process only
            on_loaded=lambda e: self.router.opened(e.group_key),
            on_dropped=self._forget,
        )

    @property
    def policy_version(self) -> int:
        return self.weights.version

    @property
    def inflight(self) -> int:
        """Steps accepted and not yet ended."""
        return sum(self.admit.inflight.values())

    def _fleet_version(self) -> int:
        """The version staleness is measured against: the fleet's when this bridge is in one."""
        fleet = self.fleet.version if self.fleet is not None else 0
        return max(self.weights.version, fleet)

    def attach_fleet(self, fleet: FleetMembership) -> None:
        """Join a fleet (before ``start``): versions, weight updates and replicas are then the fleet's."""
        self.fleet = fleet

    async def start(self) -> None:
        """Start background work (the shared load board of a Redis index; the fleet membership)."""
        self.router.start()
        if self.fleet is not None:
            await self.fleet.start()

    def _salt(self, tenant: str, model: str, version: int, adapter: str = "") -> str:
        """Salt of prefix-cache keys: per tenant, policy version and adapter version (stale KV is never matched)."""
        return salt_text(model, version, tenant, self.adapters.ref(adapter).served if adapter else "")

    def mark_replica(self, replica: int, healthy: bool, reason: str = "") -> None:
        """Take a replica out of rotation (a call failed, a health check did) or bring it back (``Replicas.mark``)."""
        self.replicas.mark(replica, healthy, reason)

    async def _forget(self, episode: Episode) -> None:
        """Drop an ended episode's routing state (and its group's, with its last member)."""
        await self.router.forget(episode.id, episode.group_key)

    # -- validation ---------------------------------------------------------------------

    def _check_model(self, model: str, adapter: str = "") -> tuple[str, str]:
        """(the model, the LoRA adapter or ""): ``model`` may name a loaded adapter, as on vLLM's OpenAI routes."""
        if not adapter and self.adapters.known(model):
            return self.info.model, model
        if model and model != self.info.model:
            raise InvalidArgument(f"unknown model {model!r}; this bridge serves {self.info.model!r}")
        if adapter:
            self.adapters.ref(adapter)  # InvalidArgument naming the loaded ones
        return self.info.model, adapter

    def _render(self, messages: Sequence[Message], history: Sequence[int] | None, tools: Sequence[str]) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument(f"engine {self.info.engine!r} has no tokenizer: send token ids, not messages")
        for i, m in enumerate(messages):
            if m.role not in VALID_ROLES:
                raise InvalidArgument(f"messages[{i}].role = {m.role!r}; expected one of {sorted(VALID_ROLES)}")
        if history is None:
            return self.tokenizer.render_prompt(messages, tools)
        return self.tokenizer.render_continuation(messages, history)

    # -- StartEpisode -------------------------------------------------------------------

    async def start_episode(self, req: StartRequest) -> StartResult:
        model, adapter = self._check_model(req.model, req.adapter)
        if self.fleet is not None:  # the prompt's tokens are labelled with the fleet's version
            await self.fleet.before_turn()
        if not 1 <= req.group_size <= self.admission.max_group_size:
            raise InvalidArgument(f"group_size must be in [1, {self.admission.max_group_size}], got {req.group_size}")
        params = self.defaults.merge(req.sampling)
        self.admit.check_sampling(params)
        if req.env:
            return await self._start_env_episodes(req, model, adapter, params)
        if req.prompt_messages is not None:
            if not req.prompt_messages:
                raise InvalidArgument("prompt_messages is empty: send at least one message")
            prompt = self._render(req.prompt_messages, None, req.tool_schemas)
        elif req.prompt_ids:
            prompt = list(req.prompt_ids)
            check_token_ids(prompt, self.info.vocab_size, "prompt_token_ids")
        else:
            raise InvalidArgument("the prompt is empty: set prompt_token_ids or prompt_messages")
        self.admit.check_length(len(prompt), "the prompt")
        self.store.admit(req.group_size, req.tenant, self.admission.max_episodes_per_tenant)
        result = await self._add_episodes(req, model, adapter, params, prompt)
        await self.episodes.save_all([e for i in result.episode_ids if (e := self.store.peek(i)) is not None])
        if self.fleet is not None:
            await self.fleet.own(list(result.episode_ids))
        return result

    async def _start_env_episodes(
        self, req: StartRequest, model: str, adapter: str, params: SamplingParams
    ) -> StartResult:
        if req.prompt_ids or req.prompt_messages is not None or req.tool_schemas:
            raise InvalidArgument(
                f"environment {req.env!r} supplies the prompt and the tool schemas: leave prompt_token_ids, "
                "prompt_messages and tool_schemas_json empty"
            )
        if self.tokenizer is None:
            raise InvalidArgument(f"engine {self.info.engine!r} has no tokenizer; episodes with an env need one")
        check_env_name(req.env)
        self.store.admit(req.group_size, req.tenant, self.admission.max_episodes_per_tenant)
        sessions = await open_env_sessions(req.env, self.envhub, req.group_size, req.env_task_id or None, req.env_seed)
        try:
            first = sessions[0].env
            prompt = self._render(first.prompt_messages, None, first.tool_schemas)
            self.admit.check_length(len(prompt), "the environment's prompt")
            # Again: other episodes may have started while the envs opened.
            self.store.admit(req.group_size, req.tenant, self.admission.max_episodes_per_tenant)
        except BaseException:
            await close_all(sessions)
            raise
        result = await self._add_episodes(req, model, adapter, params, prompt)
        self._envs.update(zip(result.episode_ids, sessions, strict=True))
        if self.fleet is not None:
            await self.fleet.own(list(result.episode_ids))
        return replace(result, env_task_id=sessions[0].task_id)

    async def _add_episodes(
        self, req: StartRequest, model: str, adapter: str, params: SamplingParams, prompt: list[int]
    ) -> StartResult:
        group_id = req.group_id or f"grp-{uuid.uuid4().hex[:16]}"
        key = f"{req.tenant}/{group_id}"  # group ids are the client's: scoped by tenant
        shared = req.group_size > 1 or bool(req.group_id)
        first_id = self.store.new_id()
        est = len(prompt) + params.max_tokens
        salt = self._salt(req.tenant, model, self.policy_version, adapter)
        route = RouteRequest(first_id, key if shared else "", prompt, salt, est, first_turn=True)
        replica = await self.router.place(route)
        version = self.adapters.ref(adapter).version if adapter else self.engines[replica].policy_version
        ids = []
        for i in range(req.group_size):
            member = params if params.seed is None else replace(params, seed=(params.seed + i) % 2**63)
            episode = Episode(
                id=first_id if i == 0 else self.store.new_id(),
                tenant=req.tenant,
                model=model,
                adapter=adapter,
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
        self.inspector.started(ids, self.store.peek)
        return StartResult(ids, group_id, version, self.info.engine, self.engines[replica].info.replica, len(prompt))

    # -- Step ---------------------------------------------------------------------------

    async def prepare_step(self, req: StepRequest) -> StepHandle:
        """Validate, admit, route and open a Step; returns the accepted Step, or raises having written nothing.

        With persistence the Step holds the episode's lease from here until ``StepHandle.close``,
        starts from the newest persisted record, and writes the record back once its turn is closed.
        """
        deadline = None if req.deadline_s is None else asyncio.get_running_loop().time() + req.deadline_s
        leased = await self._admit_step(req, deadline)
        handle: StepHandle | None = None
        try:
            handle = self._validated_step(req, leased, deadline)
            handle.episode.busy = True  # validated: from here on the episode changes, and the turn is always closed
            episode = handle.episode
            # The turn's one salt: routed with here, carried by its engine request (``Turns.open``).
            handle.salt_version = self.policy_version
            handle.salt = self._salt(episode.tenant, episode.model, handle.salt_version, episode.adapter)
            await self.router.route(
                episode, handle.observation, handle.params.max_tokens, handle.salt, episode.routing_group
            )
            if handle.session is None:
                handle.turn, handle.turn_params = self.turns.open(
                    episode, handle.observation, handle.params, handle.step_seed, handle.salt, handle.salt_version
                )
            self.inspector.step_started(episode)
            return handle
        except BaseException:
            if handle is not None:
                await handle.close()
            else:
                self.admit.leave(req.tenant)
                if leased:
                    await self.episodes.unlease(req.episode_id)
            raise

    async def _admit_step(self, req: StepRequest, deadline: float | None) -> bool:
        """Wait while paused, lease and sync the episode, count the Step in; returns whether it is leased.

        A pause that began meanwhile (a fleet-wide weight update drains Steps counted in) sends the Step back
        to wait, so no turn opens between a bridge's drain and the end of an update.
        """
        while True:
            if self.fleet is not None:
                await self.fleet.before_turn()  # adopt the fleet's version before this turn's tokens and salt
            if not self._serving.is_set():
                await self._wait_for_resume(deadline)
            leased = await self.episodes.lease(req.episode_id)
            try:
                await self.episodes.sync(req.episode_id)
                self.admit.enter(req.tenant)
            except BaseException:
                if leased:
                    await self.episodes.unlease(req.episode_id)
                raise
            if self._serving.is_set():
                return leased
            self.admit.leave(req.tenant)
            if leased:
                await self.episodes.unlease(req.episode_id)

    def _validated_step(self, req: StepRequest, leased: bool, deadline: float | None) -> StepHandle:
        """Every check of a Step, before anything changes; the handle of the Step if it passes."""
        episode = self.store.get(req.episode_id, req.tenant)
        if episode.busy:
            raise EpisodeBusy(f"episode {episode.id!r} already has a Step in progress; wait for it to finish")
        self.admit.check_fresh(episode, self._fleet_version, self.adapters)
        params = episode.sampling.merge(req.sampling)
        self.admit.check_sampling(params)
        session = self._envs.get(episode.id)
        observation: list[int] = []
        if session is not None:
            session.check_steppable(episode.id)
            if req.observation_ids or req.observation_messages:
                raise InvalidArgument(
                    f"episode {episode.id!r} runs environment {session.name!r}, which supplies its observations: "
                    "send no observation"
                )
        elif req.observation_messages:
            observation = self._render(req.observation_messages, episode.token_ids, ())
        else:
            observation = list(req.observation_ids or ())
            check_token_ids(observation, self.info.vocab_size, "observation_token_ids")
        self.admit.check_length(len(episode.token_ids) + len(observation), "the episode history")
        return StepHandle(
            episode=episode,
            turns=self.turns,
            params=params,
            step_seed=req.sampling.seed is not None,
            deadline=deadline,  # the whole Step's, a wait while paused included
            release=self._release_step,
            hold_last=self.journal is not None,
            observation=observation,
            session=session,
            tokenizer=self.tokenizer,
            opened_turns=len(episode.turns),
            tenant=req.tenant,
            leased=leased,
        )

    async def _release_step(self, handle: StepHandle) -> None:
        """A Step ended (whatever happened): the episode is idle again, written back and unleased."""
        episode = handle.episode
        episode.busy = False
        self.admit.leave(handle.tenant)
        self.inspector.step_ended(episode, handle.opened_turns)
        try:
            if len(episode.turns) != handle.opened_turns:  # the Step opened a turn (closed by now)
                await self.episodes.save(episode)
        finally:
            if handle.leased:
                await self.episodes.unlease(episode.id)

    # -- pause / resume (prime-rl's admin names) ---------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._serving.is_set()

    async def pause(self, abort: bool) -> int:
        """Start no new turn until ``resume``: new Steps wait (within their deadline). With ``abort`` the turns
        running now are aborted too (finish reason ABORT, their partial tokens kept); returns how many."""
        self._serving.clear()
        self.inspector.paused()
        log.info("paused: new Steps wait for resume%s", "; aborting the running turns" if abort else "")
        return await self.turns.abort_all() if abort else 0

    def resume(self) -> None:
        self._serving.set()
        self.inspector.resumed()
        log.info("resumed")

    async def _wait_for_resume(self, deadline: float | None) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await self._serving.wait()
        except TimeoutError:
            raise DeadlineExceeded("the bridge is paused (POST /resume) and the Step's deadline passed") from None

    # -- EndEpisode ---------------------------------------------------------------------

    async def end_episode(self, req: EndRequest) -> EndResult:
        leased = await self.episodes.lease(req.episode_id)
        try:
            await self.episodes.sync(req.episode_id)
            return await self._end_episode(req)
        finally:
            if leased:
                await self.episodes.unlease(req.episode_id)

    def _check_rewards(self, req: EndRequest, episode: Episode) -> None:
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

    async def _end_episode(self, req: EndRequest) -> EndResult:
        episode = self.store.get(req.episode_id, req.tenant)
        if episode.busy:
            raise EpisodeBusy(f"episode {episode.id!r} has a Step in progress; end it after the Step finishes")
        if not req.discard:  # a discarded episode's rewards are dropped with it
            self._check_rewards(req, episode)
        await self.episodes.delete(episode)
        self.store.pop(episode.id, req.tenant)
        if self.fleet is not None:
            await self.fleet.disown(episode.id)
        await self._forget(episode)
        rewards = req.rewards
        if (session := self._envs.pop(episode.id, None)) is not None:
            await session.close()
            episode.metadata.update(session.metadata())
            if not rewards and session.loop.done and session.loop.reward is not None:
                rewards = (float(session.loop.reward),)  # the grader's, unless the trainer sent its own
        await self.engines[episode.replica].release(episode.id)
        duration = (time.perf_counter() - episode.created) * 1e3
        self.inspector.ended(episode, rewards, req.turn_rewards, duration, req.discard)
        if req.discard:  # freed: no trajectory is built or returned
            return EndResult(None, (), (), 0.0)
        return EndResult(episode, rewards, req.turn_rewards, duration)

    # -- lifecycle and weights ----------------------------------------------------------

    async def close(self) -> None:
        """Close the environments of episodes still open (at shutdown, after in-flight Steps drained)."""
        sessions, self._envs = list(self._envs.values()), {}
        await close_all(sessions)
        await self.router.close()
        await self.adapters.close()
        if self.fleet is not None:
            await self.fleet.close()

    async def update_weights(
        self,
        checkpoint_path: str,
        policy_version: int,
        keep_kv: bool,
        model: str = "",
        mode: str = "keep",
        proof: WeightProof | None = None,
        adapter: str = "",
    ) -> int:
        """Prepare (check the checkpoint and the proof, nothing paused), then apply and verify with no turn running
        (``server.weights``), commit or roll back; in a fleet as one fleet operation (``server.fleet.member``)."""
        adapter = adapter or self._check_model(model)[1]  # (``model`` may name the adapter, as on OpenAI routes)
        if adapter:  # a new version of a LoRA adapter beside the serving one, nothing paused (``server.adapters``)
            return await self.adapters.update(adapter, checkpoint_path, policy_version, proof, self.fleet is not None)
        self.weights.check(policy_version, proof)
        began = time.perf_counter()
        await self.weights.prepare(checkpoint_path)
        self.metrics.weight_update_phase("prepare", time.perf_counter() - began)
        try:
            if self.fleet is None:
                async with self.weights.gate, exclusive(self, mode, self.admission.weight_update_drain_s, self.metrics):
                    return await self.weights.update(checkpoint_path, policy_version, keep_kv, proof)
            return await self.fleet.update_weights(
                checkpoint_path, policy_version, mode, lambda v: self.weights.update(checkpoint_path, v, keep_kv, proof)
            )
        finally:
            self.metrics.weight_update_phase("total", time.perf_counter() - began)

    async def reload_weights(self, policy_version: int = 0) -> int:
        """Back to the weights the engines started from, as a new policy version (prime-rl's reload_weights)."""
        self.weights.check(policy_version, reload=True)
        if self.fleet is None:
            async with self.weights.gate, exclusive(self, "keep", self.admission.weight_update_drain_s, self.metrics):
                return await self.weights.reload(policy_version)
        return await self.fleet.update_weights(self.info.base_weights, policy_version, "keep", self.weights.reload)
