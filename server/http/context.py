"""What every route of the front door shares: the bridge, sessions, callers (auth) and request bodies.

Authentication uses the gRPC surface's tenant tokens (``server.auth.tenant_for``): with auth on, every
route but ``/health``, ``/liveness`` and ``/openapi.json`` needs ``Authorization: Bearer <token>``, either
a tenant token or a session key (``sess-...``, from ``POST /v1/sessions``), which acts as its session's
tenant for that one session only. With auth off any bearer (verifiers sends ``EMPTY``) is tenant "".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from core.errors import PermissionDenied, Unauthenticated
from core.proof import WeightProof
from observability.metrics import BridgeMetrics
from server.auth import bearer_token, tenant_for
from server.bridge import Bridge
from server.http.errors import BadParam, BodyTooLarge, error_for_validation, error_response
from server.http.runner import Runner
from server.http.sessions import Session, SessionRegistry
from server.requestid import current_request_id, new_request_id

log = logging.getLogger("primerl.server.http")
audit = logging.getLogger("primerl.audit")

SESSION_HEADER = "X-Session-ID"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    session: Session | None = None  # set when the bearer was a session key: the only session it may use


@dataclass
class FrontDoor:
    """The front door's shared state (``request.app.state.door``)."""

    bridge: Bridge
    registry: SessionRegistry
    runner: Runner
    metrics: BridgeMetrics
    tenants: dict[str, str]  # sha256 digest -> tenant (empty: auth off)
    admins: frozenset[str]
    max_body_bytes: int
    # After a weight route ran here: the same update on the bridge's other workers (``primerl serve --workers``;
    # None with one worker). Arguments: checkpoint path, the version loaded, keep_kv, the caller's Authorization, the
    # caller's proof (every worker's replicas must match it too).
    weights_changed: Callable[[str, int, bool, str, WeightProof | None], Awaitable[None]] | None = None

    @property
    def auth_on(self) -> bool:
        return bool(self.tenants)

    def caller(self, request: Request) -> Caller:
        token = bearer_token(request.headers.get("authorization"))
        if token and token.startswith("sess-") and (session := self.registry.by_key(token)) is not None:
            return Caller(session.tenant, session)
        if not self.auth_on:
            return Caller("")
        tenant = tenant_for(self.tenants, token)
        if tenant is None:
            message = "missing bearer token" if not token else "invalid bearer token"
            raise Unauthenticated(f"{message}: send 'Authorization: Bearer <token>' (a tenant token or a session key)")
        return Caller(tenant)

    def admin(self, request: Request, what: str) -> Caller:
        caller = self.caller(request)
        if self.auth_on:
            allowed = caller.session is None and caller.tenant in self.admins
            audit.info("tenant %r called HTTP %s: %s", caller.tenant, what, "allowed" if allowed else "denied")
            if not allowed:
                raise PermissionDenied(f"tenant {caller.tenant!r} may not call {what}; list it in auth.admin_tenants")
        return caller

    async def body(self, request: Request, model: type[M]) -> M:
        """The request's JSON body as ``model`` (400 naming the field; 413 beyond ``http.max_body_bytes``)."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise BodyTooLarge(f"the request body has {size} bytes; the limit is {self.max_body_bytes}")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise BodyTooLarge(f"the request body has {len(raw)} bytes; the limit is {self.max_body_bytes}")
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadParam("body", f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadParam("body", "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise error_for_validation(exc) from None

    async def session(self, request: Request, caller: Caller, **fields: Any) -> Session:
        """The call's session: the session key's, the ``X-Session-ID`` one (created on first use), or a new one."""
        sid = request.headers.get(SESSION_HEADER)
        if caller.session is not None:
            if sid and sid != caller.session.id:
                raise PermissionDenied(f"this session key belongs to session {caller.session.id!r}, not {sid!r}")
            return caller.session
        if sid:
            found = self.registry.find(caller.tenant, sid)
            if found is not None:
                return found
        return await self.registry.create(caller.tenant, sid or None, **fields)


Handler = Callable[[Request, FrontDoor], Awaitable[Response]]


def endpoint(route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: request id set, errors as OpenAI error JSON, counted in the HTTP metrics."""

    async def serve(request: Request) -> Response:
        door: FrontDoor = request.app.state.door
        current_request_id.set(new_request_id(request.headers.get("x-request-id", "")))
        started = time.perf_counter()
        try:
            response = await handler(request, door)
        except Exception as exc:  # noqa: BLE001 - every error becomes its OpenAI error JSON (bugs: 500, logged)
            response = error_response(exc)
        response.headers["x-request-id"] = current_request_id.get()
        door.metrics.http_requests.labels(route, str(response.status_code)).inc()
        door.metrics.http_duration.labels(route).observe(time.perf_counter() - started)
        return response

    return serve
