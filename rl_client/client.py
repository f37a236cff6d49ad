"""Trainer-side clients: ``AsyncBridgeClient`` and its sync facade ``BridgeClient``.

Retries: only UNAVAILABLE, and only before the bridge accepted the call. The bridge sends
response headers once a request is validated and recorded, and gRPC's own retry policy
(below) never retries a call after headers arrived, so a retried Step can never append an
observation twice. Retries are bounded by attempts and by the call's deadline.

Session tracking: the client remembers the episodes it opened and frees the ones still open
on ``close()`` (also on ``async with`` exit).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from core.proof import WeightProof
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from rl_client.convert import is_token_ids, messages_pb, sampling_params, trajectory, turn_result
from rl_client.errors import BridgeError, from_rpc_error
from rl_client.types import (
    ORIGINS,
    Chunk,
    Prompt,
    Sampling,
    Started,
    Trajectory,
    TurnResult,
)

T = TypeVar("T")
R = TypeVar("R")

_RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "primerl.v1.PrimeRL"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class AsyncBridgeClient:
    """Asynchronous client of a PrimeRL bridge (one per event loop)."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 600.0,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        options = [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", _RETRY_SERVICE_CONFIG),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = pb_grpc.PrimeRLStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self.open_episodes: set[str] = set()
        self._finishing: set[Any] = set()  # Step calls whose final chunk is in and whose status is on its way

    async def __aenter__(self) -> AsyncBridgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None) -> T:
        try:
            return await method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None

    async def start_episode(
        self,
        prompt: Prompt = (),
        *,
        model: str = "",
        sampling: Sampling | Mapping[str, Any] | None = None,
        group_size: int = 1,
        group_id: str = "",
        tools: Sequence[Mapping[str, Any] | str] = (),
        metadata: Mapping[str, str] | None = None,
        env: str = "",
        env_task_id: str = "",
        env_seed: int | None = None,
        adapter: str = "",
        timeout: float | None = None,
    ) -> Started:
        """Open an episode (or a GRPO group of ``group_size``) from token ids or chat messages.

        With ``env`` (an env hub environment, e.g. "sql-qa") the environment supplies the prompt
        (leave ``prompt`` and ``tools`` empty) and each ``step`` runs its tool loop on the bridge.
        With ``adapter`` every turn samples with that LoRA adapter's current version (``update_weights(adapter=)``).
        """
        req = pb.StartEpisodeRequest(
            model=model,
            sampling=sampling_params(sampling),
            group_size=group_size,
            group_id=group_id,
            tool_schemas_json=[t if isinstance(t, str) else json.dumps(t) for t in tools],
            metadata=dict(metadata or {}),
            env=env,
            env_task_id=env_task_id,
            adapter=adapter,
        )
        if env_seed is not None:
            req.env_seed = env_seed
        if not prompt and env:
            pass  # no prompt field: the environment renders the prompt
        elif is_token_ids(prompt):
            req.prompt_token_ids.ids.extend(int(x) for x in prompt)  # type: ignore[arg-type]
        else:
            req.prompt_messages.CopyFrom(messages_pb(prompt))  # type: ignore[arg-type]
        resp = await self._call(self._stub.StartEpisode, req, timeout)
        self.open_episodes.update(resp.episode_ids)
        return Started(
            list(resp.episode_ids),
            resp.group_id,
            resp.policy_version,
            resp.placement.engine,
            resp.placement.replica,
            resp.prompt_tokens,
            resp.env_task_id,
        )

    def _start_step(
        self,
        episode_id: str,
        observation: Prompt | None,
        sampling: Sampling | Mapping[str, Any] | None,
        timeout: float | None,
        stream: bool,
    ) -> Any:
        """Start a Step call (the stream of its chunks; one final chunk unless ``stream``)."""
        req = pb.StepRequest(episode_id=episode_id, sampling=sampling_params(sampling), stream=stream)
        if observation:
            if is_token_ids(observation):
                req.observation_token_ids.ids.extend(int(x) for x in observation)  # type: ignore[arg-type]
            else:
                req.observation_messages.CopyFrom(messages_pb(observation))  # type: ignore[arg-type]
        return self._stub.Step(req, timeout=timeout or self.timeout, metadata=self._metadata)

    async def stream_step(
        self,
        episode_id: str,
        observation: Prompt | None = None,
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Run one turn, yielding chunks as tokens are sampled (the last has ``done``)."""
        call = self._start_step(episode_id, observation, sampling, timeout, stream=True)
        ids: list[int] = []
        logprobs: list[float] = []
        origins: list[str] = []
        raw: list[float] = []
        kept: list[float] = []
        final = False
        try:
            async for c in call:
                names = [ORIGINS[o] for o in c.origins]
                ids.extend(c.token_ids)
                logprobs.extend(c.logprobs)
                origins.extend(names)
                raw.extend(c.raw_logprobs)
                kept.extend(c.kept_logmass)
                done = turn_result(ids, logprobs, origins, c.done, raw, kept) if c.HasField("done") else None
                final = done is not None
                yield Chunk(
                    list(c.token_ids), list(c.logprobs), names, c.text, done, list(c.raw_logprobs), list(c.kept_logmass)
                )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            self._end(call, final)

    def _end(self, call: Any, final: bool) -> None:
        """Leave a Step call: cancel it if the caller stopped before the final chunk; after the final chunk, let its
        status arrive on its own. Cancelling then races the bridge's status: the bridge sends it on a cancelled
        call, and grpc.aio never frees a failed batch (grpc/grpc#43360; ~100 B of native heap per Step, the
        soak's RSS slope). The call is kept referenced until it ends: a collected live call is cancelled."""
        if call.done():
            return
        if not final:
            call.cancel()
            return
        self._finishing.add(call)
        call.add_done_callback(self._finishing.discard)

    async def step(
        self,
        episode_id: str,
        observation: Prompt | None = None,
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> TurnResult:
        """Run one turn and return it whole."""
        call = self._start_step(episode_id, observation, sampling, timeout, stream=False)
        final = False
        try:
            async for c in call:
                if c.HasField("done"):
                    final = True
                    origins = [ORIGINS[o] for o in c.origins]
                    raw, kept = list(c.raw_logprobs), list(c.kept_logmass)
                    return turn_result(list(c.token_ids), list(c.logprobs), origins, c.done, raw, kept)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            self._end(call, final)
        raise BridgeError(grpc.StatusCode.INTERNAL, "the bridge ended the Step stream without a final chunk")

    async def end_episode(
        self,
        episode_id: str,
        reward: float | Sequence[float] | None = None,
        *,
        turn_rewards: Sequence[float] = (),
        timeout: float | None = None,
    ) -> Trajectory:
        """Attach the reward(s), get the trajectory, free the episode."""
        rewards = [] if reward is None else [float(reward)] if isinstance(reward, (int, float)) else list(reward)
        req = pb.EndEpisodeRequest(episode_id=episode_id, rewards=rewards, turn_rewards=list(turn_rewards))
        resp = await self._call(self._stub.EndEpisode, req, timeout)
        self.open_episodes.discard(episode_id)
        return trajectory(resp.trajectory)

    async def discard_episode(self, episode_id: str, timeout: float | None = None) -> None:
        """Free an episode without fetching its trajectory."""
        await self._call(self._stub.EndEpisode, pb.EndEpisodeRequest(episode_id=episode_id, discard=True), timeout)
        self.open_episodes.discard(episode_id)

    async def update_weights(
        self,
        checkpoint_path: str = "",
        *,
        policy_version: int = 0,
        keep_kv: bool = False,
        model: str = "",
        proof: WeightProof | None = None,
        adapter: str = "",
    ) -> int:
        """Load new weights on every replica; returns the new policy version. With ``proof``
        (``rl_client.proof.weight_proof``) every replica must match its logprobs, else every replica goes back to
        the previous weights and the call fails (FAILED_PRECONDITION naming the replica). With ``adapter``:
        ``checkpoint_path`` is a peft LoRA directory, loaded as that adapter's next version (its own versions) beside
        the one serving, which keeps serving until the new one is proven (``proof``: the model with the adapter)."""
        req = pb.UpdateWeightsRequest(
            model=model,
            checkpoint_path=checkpoint_path,
            policy_version=policy_version,
            keep_kv=keep_kv,
            adapter=adapter,
        )
        if proof is not None:
            req.probe_token_ids.extend(proof.token_ids)
            req.probe_logprobs.extend(proof.logprobs)
            req.probe_tolerance = proof.tolerance
        resp = await self._call(self._stub.UpdateWeights, req, None)
        return resp.policy_version

    async def wait_until_ready(self, timeout: float = 120.0) -> None:
        """Block until the bridge reports SERVING on the gRPC health service (engines loaded)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                resp = await stub.Check(
                    health_pb2.HealthCheckRequest(service="primerl.v1.PrimeRL"),
                    timeout=max(0.1, left),
                    wait_for_ready=True,
                    metadata=self._metadata,
                )
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise from_rpc_error(err) from None
            if left <= 0:
                raise BridgeError(grpc.StatusCode.DEADLINE_EXCEEDED, f"bridge not SERVING after {timeout:.0f} s")
            await asyncio.sleep(min(0.5, max(0.0, left)))

    async def server_info(self) -> pb.ServerInfo:
        return await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), 30.0)

    async def score_tokens(
        self,
        token_ids: Sequence[int],
        start: int,
        *,
        temperature: float = 1.0,
        logits: bool = False,
        model: str = "",
        adapter: str = "",
    ) -> pb.ScoreTokensResponse:
        """Teacher-forced logprobs of ``token_ids[start:]`` (``ScoreTokens``); no episode, no sampling."""
        req = pb.ScoreTokensRequest(
            model=model,
            token_ids=list(token_ids),
            start=start,
            temperature=temperature,
            return_logits=logits,
            adapter=adapter,
        )
        return await self._call(self._stub.ScoreTokens, req, None)

    async def close(self) -> None:
        """Free the episodes this client left open, then close the channel."""
        for episode_id in list(self.open_episodes):
            try:
                await self.discard_episode(episode_id, timeout=5.0)
            except BridgeError:
                self.open_episodes.discard(episode_id)
        await self._channel.close(None)


async def run_episodes(
    client: AsyncBridgeClient,
    specs: Iterable[T],
    rollout: Callable[[AsyncBridgeClient, T], Awaitable[R]],
    *,
    concurrency: int = 64,
    progress: bool | str = False,
) -> list[R]:
    """Run ``rollout(client, spec)`` for every spec, at most ``concurrency`` at once, in order.

    ``progress`` shows a progress bar (its text when a string). The first failure cancels the
    rest and is raised.
    """
    items = list(specs)
    sem = asyncio.Semaphore(max(1, concurrency))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=progress if isinstance(progress, str) else "episodes", unit="ep")

    async def one(spec: T) -> R:
        async with sem:
            result = await rollout(client, spec)
        if bar is not None:
            bar.update(1)
        return result

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(s), name=f"rollout-{i}") for i, s in enumerate(items)]
    finally:
        if bar is not None:
            bar.close()
    return [t.result() for t in tasks]


class BridgeClient:
    """Synchronous facade over ``AsyncBridgeClient`` (runs it on a private event loop thread)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="primerl-client-loop", daemon=True)
        self._thread.start()
        self._client: AsyncBridgeClient = self._run(self._make(target, kwargs))

    @staticmethod
    async def _make(target: str, kwargs: dict[str, Any]) -> AsyncBridgeClient:
        return AsyncBridgeClient(target, **kwargs)

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def open_episodes(self) -> set[str]:
        return self._client.open_episodes

    @property
    def aio(self) -> AsyncBridgeClient:
        """The underlying async client (use it only from ``run_episodes`` rollouts)."""
        return self._client

    def start_episode(self, prompt: Prompt = (), **kwargs: Any) -> Started:
        return self._run(self._client.start_episode(prompt, **kwargs))

    def step(self, episode_id: str, observation: Prompt | None = None, **kwargs: Any) -> TurnResult:
        return self._run(self._client.step(episode_id, observation, **kwargs))

    def stream_step(self, episode_id: str, observation: Prompt | None = None, **kwargs: Any) -> Iterator[Chunk]:
        stream = self._client.stream_step(episode_id, observation, **kwargs)
        try:
            while True:
                try:
                    yield self._run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def end_episode(self, episode_id: str, reward: float | Sequence[float] | None = None, **kwargs: Any) -> Trajectory:
        return self._run(self._client.end_episode(episode_id, reward, **kwargs))

    def discard_episode(self, episode_id: str) -> None:
        self._run(self._client.discard_episode(episode_id))

    def update_weights(self, checkpoint_path: str = "", **kwargs: Any) -> int:
        return self._run(self._client.update_weights(checkpoint_path, **kwargs))

    def server_info(self) -> pb.ServerInfo:
        return self._run(self._client.server_info())

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine that uses ``aio`` on the client's event loop, and return its result."""
        return self._run(coro)

    def score_tokens(self, token_ids: Sequence[int], start: int, **kwargs: Any) -> pb.ScoreTokensResponse:
        return self._run(self._client.score_tokens(token_ids, start, **kwargs))

    def wait_until_ready(self, timeout: float = 120.0) -> None:
        self._run(self._client.wait_until_ready(timeout))

    def run_episodes(
        self,
        specs: Iterable[T],
        rollout: Callable[[AsyncBridgeClient, T], Awaitable[R]],
        *,
        concurrency: int = 64,
        progress: bool | str = False,
    ) -> list[R]:
        """Run async ``rollout`` coroutines concurrently (see ``rl_client.run_episodes``)."""
        return self._run(run_episodes(self._client, specs, rollout, concurrency=concurrency, progress=progress))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


__all__ = ["AsyncBridgeClient", "BridgeClient", "run_episodes"]
