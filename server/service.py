"""gRPC servicer: protobuf <-> typed bridge calls, and errors -> gRPC status.

This is the only place (with ``rl_client``) where protobuf meets the bridge. Every handler
runs under ``_status_for``: a ``PrimeRLError`` becomes its own status code with its message;
anything else is a bug, logged with its traceback and reported as INTERNAL without detail.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from core.proof import WeightProof
from core.types import Message
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from server.auth import current_tenant
from server.bridge import Bridge
from server.calls import NO_OVERRIDES, EndRequest, SamplingOverrides, StartRequest, StepRequest, StepUpdate
from server.envsession import EnvOutcome
from server.episodes import Turn
from server.errors import PrimeRLError, status_code
from server.scoring import score_tokens

log = logging.getLogger("primerl.server")

SERVER_VERSION = "0.1.0"
ACCEPTED_METADATA = (("primerl-accepted", "1"),)
# Episode / Turn attributes that a Trajectory / TrajectoryTurn field of the same name carries as is.
_TRAJECTORY_FIELDS = (
    "group_id",
    "model",
    "token_ids",
    "logprobs",
    "loss_mask",
    "origins",
    "prompt_length",
    "metadata",
    "group_index",
    "adapter",
)
_TURN_FIELDS = ("observation_start", "generation_start", "end", "policy_version", "latency_ms", "ttft_ms")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, PrimeRLError):
        code, message = status_code(exc), exc.message
    else:
        log.exception("internal error in %s", type(exc).__name__)
        code, message = grpc.StatusCode.INTERNAL, "internal error in the bridge; see the server log"
    retry = getattr(exc, "retry_after_s", None)
    trailers = (("retry-after-ms", str(round(retry * 1000))),) if retry is not None else ()
    try:
        await context.abort(code, message, trailers)
    except grpc.aio.AbortError:
        raise
    except Exception as failed:  # noqa: BLE001 - the core could not send the status: the call already ended
        # (its deadline passed or the client left while the error was being raised); the client has its
        # status, so end the handler as a cancelled call instead of logging the core's failure.
        log.debug("status %s for a call that had already ended: %r", code.name, failed)
        raise asyncio.CancelledError from None


def _overrides(p: pb.SamplingParams) -> SamplingOverrides:
    """The fields the request set, by name (proto and ``SamplingParams`` share them: test_proto_mirrors)."""
    fields = p.ListFields()  # only the set ones (a repeated field: when non-empty)
    if not fields:  # nothing set (most Steps)
        return NO_OVERRIDES
    return SamplingOverrides({f.name: v for f, v in fields})


def _messages(m: pb.Messages) -> tuple[Message, ...]:
    return tuple(Message(role=x.role, content=x.content, name=x.name) for x in m.messages)


def _env_status(o: EnvOutcome) -> pb.EnvStatus:
    status = pb.EnvStatus(
        done=o.done, reason=o.reason, tool_calls=o.tool_calls, turns=o.turns, truncated=o.truncated, error=o.error
    )
    if o.reward is not None:
        status.reward = o.reward
    return status


def _turn_tail(token_ids: Sequence[int], turn: Turn, streamed: int) -> Sequence[int]:
    """The last turn's sampled tokens that a Step which streamed ``streamed`` tokens sent, read from the episode
    (``token_ids``): the Step's tokens end with the turn's, so this is the tail of what the Step streamed, and
    slicing it touches the turn only, never what the Step or the episode held before."""
    return token_ids[turn.end - min(turn.end - turn.generation_start, streamed) : turn.end]


def _usage(turn: Turn) -> pb.Usage:
    u = turn.usage
    return pb.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens, generated_tokens=u.generated_tokens)


class PrimeRLService(pb_grpc.PrimeRLServicer):
    def __init__(self, bridge: Bridge, stream_interval_ms: float = 0.0) -> None:
        self.bridge = bridge
        self.stream_interval_s = stream_interval_ms / 1e3

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return current_tenant.get()  # set by server.auth.AuthInterceptor; "" when auth is off

    def _decode(self, ids: Sequence[int]) -> str:
        tok = self.bridge.tokenizer
        return tok.decode(ids) if tok is not None and ids else ""

    async def StartEpisode(
        self, request: pb.StartEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartEpisodeResponse:
        try:
            kind = request.WhichOneof("prompt")
            result = await self.bridge.start_episode(
                StartRequest(
                    model=request.model,
                    prompt_ids=tuple(request.prompt_token_ids.ids) if kind == "prompt_token_ids" else None,
                    prompt_messages=_messages(request.prompt_messages) if kind == "prompt_messages" else None,
                    tool_schemas=tuple(request.tool_schemas_json),
                    sampling=_overrides(request.sampling),
                    group_size=request.group_size or 1,
                    group_id=request.group_id,
                    metadata=dict(request.metadata),
                    tenant=self._tenant(context),
                    env=request.env,
                    env_task_id=request.env_task_id,
                    env_seed=request.env_seed if request.HasField("env_seed") else None,
                    adapter=request.adapter,
                )
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.StartEpisodeResponse(
            episode_ids=result.episode_ids,
            group_id=result.group_id,
            policy_version=result.policy_version,
            placement=pb.Placement(engine=result.engine, replica=result.replica),
            prompt_tokens=result.prompt_tokens,
            env_task_id=result.env_task_id,
        )

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepChunk]:
        kind = request.WhichOneof("observation")
        req = StepRequest(
            episode_id=request.episode_id,
            observation_ids=tuple(request.observation_token_ids.ids) if kind == "observation_token_ids" else None,
            observation_messages=_messages(request.observation_messages) if kind == "observation_messages" else None,
            sampling=_overrides(request.sampling),
            tenant=self._tenant(context),
            deadline_s=context.time_remaining(),
        )
        # The Step's tokens not sent yet: all of them for a unary Step, what arrived since the last chunk for a
        # streamed one (which may run for a whole trajectory: an env's tool loop samples several turns).
        ids: list[int] = []
        logprobs: list[float] = []
        raw: list[float] = []  # raw (temperature-1) logprobs, sent only if the engine reports them
        raw_seen = False
        kept: list[float] = []  # log kept mass (sampling.kept_mass), sent only if reported
        kept_seen = False
        origins: list[int] = []
        streamed = 0  # tokens of the Step so far, sent or not
        last_sent = 0.0
        try:
            handle = await self.bridge.prepare_step(req)
        except Exception as exc:
            await _abort(context, exc)
            raise
        updates = handle.updates()
        try:
            await context.send_initial_metadata(ACCEPTED_METADATA)  # accepted: the client's retry policy stops
            async for u in updates:
                if u.last and u.turn is not None and not streamed:  # the whole Step in one update (most unary Steps)
                    yield self._whole(u, u.turn)
                    continue
                ids.extend(u.token_ids)
                logprobs.extend(u.logprobs)
                raw_seen = raw_seen or bool(u.raw_logprobs)
                raw.extend(u.raw_logprobs if len(u.raw_logprobs) == len(u.token_ids) else [math.nan] * len(u.token_ids))
                kept_seen = kept_seen or bool(u.kept_logmass)
                n_new = len(u.token_ids)
                kept.extend(u.kept_logmass if len(u.kept_logmass) == n_new else [math.nan] * n_new)
                origins.extend(u.origins)
                streamed += len(u.token_ids)
                if u.turn is None or not u.last:
                    if not request.stream or not ids:
                        continue
                    now = time.perf_counter()
                    if now - last_sent < self.stream_interval_s:
                        continue  # coalesce: tokens are arriving faster than chunks are worth sending
                    last_sent = now
                turn = u.turn if u.last else None
                turn_ids = _turn_tail(handle.episode.token_ids, turn, streamed) if turn is not None else ()
                chunk = self._chunk(ids, logprobs, origins, turn, turn_ids)
                if turn is not None and u.env is not None:
                    chunk.done.env.CopyFrom(_env_status(u.env))
                if raw_seen:
                    chunk.raw_logprobs.extend(raw)
                if kept_seen:
                    chunk.kept_logmass.extend(kept)
                yield chunk
                ids, logprobs, raw, kept, origins = [], [], [], [], []
        except Exception as exc:
            await _abort(context, exc)
            raise
        finally:
            await updates.aclose()
            await handle.close()

    def _whole(self, u: StepUpdate, turn: Turn) -> pb.StepChunk:
        """The one chunk of a Step whose tokens came in one update: built from the update's tuples, no copies
        (what the general path of ``Step`` sends for it, field for field)."""
        ids = u.token_ids
        n = len(ids)
        chunk = self._chunk(ids, u.logprobs, u.origins, turn, ids[max(0, n - (turn.end - turn.generation_start)) :])
        if u.env is not None:
            chunk.done.env.CopyFrom(_env_status(u.env))
        if u.raw_logprobs:
            chunk.raw_logprobs.extend(u.raw_logprobs if len(u.raw_logprobs) == n else [math.nan] * n)
        if u.kept_logmass:
            chunk.kept_logmass.extend(u.kept_logmass if len(u.kept_logmass) == n else [math.nan] * n)
        return chunk

    def _chunk(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        origins: Sequence[int],
        turn: Turn | None,
        turn_ids: Sequence[int],
    ) -> pb.StepChunk:
        """One StepChunk; with ``turn`` set it is the last one (``turn_ids``: the turn's tokens, for its text)."""
        chunk = pb.StepChunk(token_ids=ids, logprobs=logprobs, origins=origins)  # type: ignore[arg-type]
        if ids and turn is None:
            chunk.text = self._decode(ids)
        if (t := turn) is not None:
            done = chunk.done  # filled in place: no TurnDone built and then copied
            done.finish_reason = int(t.finish_reason or 0)  # type: ignore[assignment]
            usage, u = done.usage, t.usage  # set in place: no Usage message built and then copied
            usage.prompt_tokens, usage.cached_tokens, usage.generated_tokens = (
                u.prompt_tokens,
                u.cached_tokens,
                u.generated_tokens,
            )
            done.policy_version = t.policy_version
            done.turn_index = t.index
            done.text = self._decode(turn_ids)
        return chunk

    async def EndEpisode(
        self, request: pb.EndEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndEpisodeResponse:
        try:
            result = await self.bridge.end_episode(
                EndRequest(
                    episode_id=request.episode_id,
                    rewards=tuple(request.rewards),
                    turn_rewards=tuple(request.turn_rewards),
                    discard=request.discard,
                    tenant=self._tenant(context),
                )
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        ep = result.episode
        if ep is None:  # discarded: freed without a trajectory
            return pb.EndEpisodeResponse()
        traj = pb.Trajectory(
            episode_id=ep.id,
            **{name: getattr(ep, name) for name in _TRAJECTORY_FIELDS},
            policy_versions=ep.versions,
            rewards=result.rewards,
            turn_rewards=result.turn_rewards,
            duration_ms=result.duration_ms,
            raw_logprobs=ep.raw_logprobs if any(not math.isnan(x) for x in ep.raw_logprobs) else (),
            kept_logmass=ep.kept_logmass if any(not math.isnan(x) for x in ep.kept_logmass) else (),
        )
        for t in ep.turns:
            traj.turns.add(
                **{name: getattr(t, name) for name in _TURN_FIELDS},
                finish_reason=int(t.finish_reason or 0),
                usage=_usage(t),
            )
        return pb.EndEpisodeResponse(trajectory=traj)

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        before = self.bridge.policy_version
        try:
            proof = WeightProof.of(request.probe_token_ids, request.probe_logprobs, request.probe_tolerance)
            version = await self.bridge.update_weights(
                request.checkpoint_path,
                request.policy_version,
                request.keep_kv,
                request.model,
                proof=proof,
                adapter=request.adapter,
            )
        except Exception as exc:
            if self.bridge.policy_version != before:  # applied on some replicas: the client must not retry it
                await context.send_initial_metadata(ACCEPTED_METADATA)
            await _abort(context, exc)
            raise
        what = f"adapter {request.adapter!r}" if request.adapter else "weights"
        log.info("%s updated to policy version %d from %r", what, version, request.checkpoint_path)
        adapters = self.bridge.adapters
        name = request.adapter or (request.model if adapters.known(request.model) else "")  # as Bridge._check_model
        serving = adapters.serving(name) if name else self.bridge.weights.serving(version)
        return pb.UpdateWeightsResponse(policy_version=version, replicas_updated=serving)

    async def ScoreTokens(
        self, request: pb.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreTokensResponse:
        try:
            return await score_tokens(self.bridge, request)
        except Exception as exc:
            await _abort(context, exc)
            raise

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        b = self.bridge
        a = b.admission
        return pb.ServerInfo(
            server_version=SERVER_VERSION,
            models=[
                pb.ModelInfo(
                    name=b.info.model,
                    engine=b.info.engine,
                    vocab_size=b.info.vocab_size,
                    max_model_len=b.info.max_model_len,
                    policy_version=b.policy_version,
                    supports_weight_updates=b.info.supports_weight_updates,
                    replicas=[e.info.replica for e in b.engines],
                    eos_token_ids=b.info.eos_token_ids,
                    has_tokenizer=b.tokenizer is not None,
                    index_sources=[b.router.index_source(r) for r in range(len(b.engines))],
                    adapters=b.adapters.versions(),
                )
            ],
            limits=pb.Limits(
                max_episodes=a.max_episodes,
                max_tokens_per_episode=a.max_tokens_per_episode,
                max_group_size=a.max_group_size,
                max_tokens_per_turn=a.max_tokens_per_turn,
            ),
            open_episodes=len(b.store),
        )
