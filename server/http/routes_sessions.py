"""Session, admin and probe routes of the front door.

- ``POST /v1/sessions``: open a session (group size, sampling defaults, tools); returns its id and a
  per-session API key usable as the Bearer token (scoped to that session only);
- ``GET /v1/sessions/{id}/trajectory``: its trajectory as JSON (the content of gRPC ``EndEpisode``);
- ``POST /v1/sessions/{id}/end``: end it with rewards; returns the final trajectory;
- admin (prime-rl's names; admin tenants only when auth is on): ``POST /update_weights``, ``/reload_weights``
  (back to the weights the engines started from, as a new version), ``/pause``, ``/resume``;
- ``GET /health`` (200 while a replica is healthy, else 503) and ``GET /liveness`` (the process is up).
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core.errors import FailedPrecondition, NotFound, Unimplemented
from core.proof import WeightProof
from core.types import SamplingOverrides
from server.http.context import Caller, FrontDoor
from server.http.errors import BadParam
from server.http.models import EndBody, PauseBody, SessionBody, UpdateWeightsBody
from server.http.render import tool_schemas
from server.http.sessions import Session

log = logging.getLogger("primerl.server.http")


async def create_session(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, SessionBody)
    caller = door.caller(request)
    if caller.session is not None:
        raise BadParam("authorization", "a session key cannot open sessions; use a tenant token")
    if body.group_size > door.bridge.admission.max_group_size:
        raise BadParam("group_size", f"group_size must be at most {door.bridge.admission.max_group_size}")
    try:
        sampling = SamplingOverrides(body.sampling)
    except TypeError as exc:
        raise BadParam("sampling", str(exc)) from None
    door.bridge.defaults.merge(sampling).validate(door.bridge.info.vocab_size)
    session = await door.registry.create(
        caller.tenant, body.session_id, group_size=body.group_size, sampling=sampling,
        tools=tool_schemas(body.tools), metadata=dict(body.metadata),
    )  # fmt: skip
    key = door.registry.issue_key(session)
    base = str(request.base_url).rstrip("/")
    out = {"id": session.id, "api_key": key, "group_size": session.group_size, "base_url": f"{base}/v1"}
    return JSONResponse(out, status_code=201, headers={"X-Session-ID": session.id})


async def trajectory(request: Request, door: FrontDoor) -> Response:
    caller = door.caller(request)
    session = _own(request, door, caller)
    return JSONResponse(door.registry.trajectory(session))


async def end_session(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, EndBody)
    caller = door.caller(request)
    session = _own(request, door, caller)
    result = await door.registry.end(session, tuple(body.rewards), tuple(body.turn_rewards), body.discard)
    return JSONResponse(result)


def _own(request: Request, door: FrontDoor, caller: Caller) -> Session:
    """The path's session, if the caller may see it (a session key: its own session and its group's members)."""
    sid = request.path_params["session_id"]
    session = door.registry.get(caller.tenant, sid)
    keyed = caller.session
    if keyed is not None and session is not keyed and session.id not in keyed.members:
        raise NotFound(f"session {sid!r} does not exist (or belongs to another tenant)")
    return session


# -- admin ----------------------------------------------------------------------------


async def update_weights(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, UpdateWeightsBody)
    door.admin(request, "update_weights")
    proof = WeightProof.of(body.probe_token_ids, body.probe_logprobs, body.probe_tolerance)
    if body.adapter:
        if door.weights_changed is not None:
            raise Unimplemented("adapter updates with --workers > 1 are not supported yet: run one worker")
        version = await door.bridge.update_weights(
            body.weight_dir, body.policy_version, body.keep_kv, proof=proof, adapter=body.adapter
        )
        log.info("adapter %r updated to version %d from %r (HTTP)", body.adapter, version, body.weight_dir)
        return JSONResponse({"status": "ok", "policy_version": version, "adapter": body.adapter})
    version = await door.bridge.update_weights(body.weight_dir, body.policy_version, body.keep_kv, proof=proof)
    log.info("weights updated to policy version %d from %r (HTTP)", version, body.weight_dir)
    await _on_other_workers(request, door, body.weight_dir, version, body.keep_kv, proof)
    return JSONResponse({"status": "ok", "policy_version": version})


async def reload_weights(request: Request, door: FrontDoor) -> Response:
    """Back to the base weights (those the engines started from), as a new policy version."""
    door.admin(request, "reload_weights")
    version = await door.bridge.reload_weights()
    log.info("weights reloaded to the base checkpoint as policy version %d (HTTP)", version)
    await _on_other_workers(request, door, door.bridge.info.base_weights, version, False, None)
    return JSONResponse({"status": "ok", "policy_version": version})


async def _on_other_workers(
    request: Request, door: FrontDoor, path: str, version: int, keep_kv: bool, proof: WeightProof | None
) -> None:
    """With ``--workers N``: the update just made here, at its version, on every other worker (each has its own
    engines); a worker it failed on is named in a 503."""
    if door.weights_changed is not None:
        await door.weights_changed(path, version, keep_kv, request.headers.get("authorization", ""), proof)


async def pause(request: Request, door: FrontDoor) -> Response:
    """Start no new turn (new calls wait for /resume); ``mode=abort`` also aborts the running turns (their
    partial tokens stay in the sessions, finish reason abort); ``keep`` and ``wait`` let them finish."""
    body = await door.body(request, PauseBody)
    door.admin(request, "pause")
    aborted = await door.bridge.pause(abort=body.mode == "abort")
    return JSONResponse({"status": "paused", "mode": body.mode, "aborted": aborted})


async def resume(request: Request, door: FrontDoor) -> Response:
    door.admin(request, "resume")
    if door.bridge.weights.gate.locked():  # its pause keeps turns off weights not yet proven; it ends with it
        raise FailedPrecondition("a weight update is running; new turns resume when it commits or rolls back")
    door.bridge.resume()
    return JSONResponse({"status": "ok"})


# -- probes ---------------------------------------------------------------------------


async def health(request: Request, door: FrontDoor) -> Response:
    states = door.metrics.engine_health
    if states and not any(states.values()):
        return Response(status_code=503)
    return Response(status_code=200)


async def liveness(request: Request, door: FrontDoor) -> Response:
    return JSONResponse({"status": "ok"})
