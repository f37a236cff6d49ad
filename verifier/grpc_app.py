"""The verifier's gRPC surface: ``primerl.v1.Verifier`` (``Score``, ``ScoreBatch``) with health and reflection.

Same semantics as the HTTP JSON surface (``app.py``), through the same ``ScoreRequest`` validation: a bad
field is INVALID_ARGUMENT with the message HTTP would put in its 400 (``trajectory.logprobs: ...``), and
every ``PrimeRLError`` keeps its status (NOT_FOUND, FAILED_PRECONDITION, DEADLINE_EXCEEDED, UNAVAILABLE: the one
map of ``core.errors``, sent through ``core.errors_grpc``); anything else is a bug, INTERNAL without its detail.
A ``ScoreBatch`` item fails alone, with the code and message a single ``Score`` would have failed with.
An item's grader deadline is the smallest of the service's ``grader_timeout_s``, the item's ``timeout_s``
and what is left of the call's gRPC deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from core.errors import InvalidArgument, PrimeRLError, grpc_code_name
from core.errors_grpc import abort
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import verifier_pb2 as vpb
from proto.primerl.v1 import verifier_pb2_grpc as vpb_grpc
from rl_client.types import Trajectory as BridgeTrajectory
from verifier.bridge import verifier_trajectory
from verifier.service import ScoreRequest, ScoreResult, Verifier, validation_fields

log = logging.getLogger("primerl.verifier")
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["Verifier"].full_name


def trajectory_json(t: pb.Trajectory) -> dict[str, Any]:
    """The token record of a ``primerl.v1.Trajectory`` as the verifier's ``Trajectory`` JSON."""
    return {
        "episode_id": t.episode_id,
        "token_ids": list(t.token_ids),
        "logprobs": [None if x != x else x for x in t.logprobs],  # x != x: NaN
        "loss_mask": list(map(int, t.loss_mask)),
        "origins": list(t.origins),
        "policy_versions": list(t.policy_versions),
    }


def _params(raw: str) -> Any:
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"params_json: not JSON ({exc})") from None


def _to_pb(t: BridgeTrajectory) -> pb.Trajectory:
    """The bridge's trajectory back on the wire (token record and identity; turns are not carried)."""
    j = verifier_trajectory(t)
    return pb.Trajectory(
        episode_id=t.episode_id,
        group_id=t.group_id,
        group_index=t.group_index,
        model=t.model,
        token_ids=j["token_ids"],
        logprobs=[float(x) for x in t.logprobs],
        loss_mask=[bool(x) for x in j["loss_mask"]],
        origins=j["origins"],
        policy_versions=j["policy_versions"],
        prompt_length=t.prompt_length,
        metadata=t.metadata,
        duration_ms=t.duration_ms,
    )


class VerifierServicer(vpb_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    async def _request(self, item: vpb.ScoreRequest, left_s: float | None) -> tuple[ScoreRequest, pb.Trajectory | None]:
        """Validate one item (ending its episode on the bridge first when it names one)."""
        ended = None
        source = item.WhichOneof("source")
        if source == "episode_id":
            ended = _to_pb(await self.verifier.end_episode(item.episode_id))
            trajectory = trajectory_json(ended)
        elif source == "trajectory":
            trajectory = trajectory_json(item.trajectory)
        else:
            raise InvalidArgument("trajectory: required (or episode_id)")
        timeout = item.timeout_s if item.timeout_s != 0 else None  # 0: unset (negative, NaN: refused below)
        if left_s is not None:
            timeout = min(timeout or left_s, left_s)
        body = {"grader": item.grader, "trajectory": trajectory, "params": _params(item.params_json)}
        try:
            return ScoreRequest.model_validate({**body, "timeout_s": timeout}), ended
        except ValidationError as exc:
            raise InvalidArgument(validation_fields(exc)[0]) from None

    async def _score(
        self, items: Sequence[vpb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> list[vpb.ScoreResponse | PrimeRLError]:
        left = context.time_remaining()
        prepared = await asyncio.gather(*(self._request(i, left) for i in items), return_exceptions=True)
        for p in prepared:
            if isinstance(p, BaseException) and not isinstance(p, PrimeRLError):
                raise p
        valid = [p for p in prepared if isinstance(p, tuple)]
        results = iter(await self.verifier.score_batch([req for req, _ in valid]) if valid else [])
        out: list[vpb.ScoreResponse | PrimeRLError] = []
        for p in prepared:
            if not isinstance(p, tuple):
                out.append(p)  # type: ignore[arg-type]
                continue
            r = next(results)
            out.append(r if isinstance(r, PrimeRLError) else _response(r, p[1]))
        return out

    async def Score(self, request: vpb.ScoreRequest, context: grpc.aio.ServicerContext) -> vpb.ScoreResponse:
        try:
            (result,) = await self._score([request], context)
        except Exception as exc:  # noqa: BLE001 - the whole call failed (the log refused the append), or a bug
            await abort(context, exc, log)
        if isinstance(result, PrimeRLError):
            await abort(context, result, log)
        assert isinstance(result, vpb.ScoreResponse)
        return result

    async def ScoreBatch(
        self, request: vpb.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> vpb.ScoreBatchResponse:
        n, most = len(request.items), self.verifier.config.max_batch_items
        if not 1 <= n <= most:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: {n} items, expected 1 to {most}")
        try:
            scored = await self._score(request.items, context)
        except Exception as exc:  # noqa: BLE001 - the whole call failed (the log refused the append), or a bug
            await abort(context, exc, log)
        results = []
        for r in scored:
            if isinstance(r, PrimeRLError):
                results.append(vpb.ScoreItemResult(error=vpb.ScoreError(code=grpc_code_name(r), message=r.message)))
            else:
                results.append(vpb.ScoreItemResult(scored=r))
        return vpb.ScoreBatchResponse(results=results)


def _response(result: ScoreResult, ended: pb.Trajectory | None) -> vpb.ScoreResponse:
    r = result.receipt
    receipt = vpb.Receipt(
        log_index=r.log_index, leaf_hash=r.leaf_hash, envelope_json=json.dumps(r.envelope, separators=(",", ":"))
    )
    return vpb.ScoreResponse(reward=result.reward, receipt=receipt, trajectory=ended)


async def start_grpc(verifier: Verifier, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server on ``host:port`` (0 = any free port); returns it and the bound port."""
    limit = 64 * 1024 * 1024
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )
    vpb_grpc.add_VerifierServicer_to_server(VerifierServicer(verifier), server)
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the verifier's gRPC port {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


__all__ = ["SERVICE_NAME", "VerifierServicer", "start_grpc", "trajectory_json"]
