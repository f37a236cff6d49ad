"""The front door's Starlette app (``create_app``) and its uvicorn server inside the bridge (``HttpFrontDoor``).

The uvicorn server runs as a named task of the bridge process on a socket bound at construction (so a
port in use fails at start-up, like the gRPC port). It never installs signal handlers: the bridge's
``server.app.serve`` owns SIGINT/SIGTERM and stops the front door before the engines close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.proof import WeightProof
from observability.metrics import BridgeMetrics
from server.bridge import Bridge
from server.http import routes_inspect as inspect
from server.http import routes_openai as oai
from server.http import routes_sessions as sess
from server.http import routes_tokens as tokens
from server.http.context import FrontDoor, endpoint
from server.http.errors import error_response
from server.http.models import (
    ChatBody,
    CompletionBody,
    EndBody,
    EventsQuery,
    GenerateBody,
    InspectQuery,
    PauseBody,
    SessionBody,
    UpdateWeightsBody,
)
from server.http.openapi import RouteSpec, build
from server.http.runner import Runner
from server.http.sessions import SessionRegistry

log = logging.getLogger("primerl.server.http")
VERSION = "0.1.0"

ROUTES = (
    RouteSpec("POST", "/inference/v1/generate", tokens.generate, "vLLM token route (token ids in, token ids out)",
              GenerateBody, session_header=True),
    RouteSpec("POST", "/v1/chat/completions", oai.chat_completions, "OpenAI chat completions", ChatBody,
              session_header=True),
    RouteSpec("POST", "/v1/completions", oai.completions, "OpenAI completions", CompletionBody, session_header=True),
    RouteSpec("GET", "/v1/models", oai.models, "Served model (id, max_model_len)"),
    RouteSpec("POST", "/v1/sessions", sess.create_session, "Open a session (returns its id and key)", SessionBody),
    RouteSpec("GET", "/v1/sessions/{session_id}/trajectory", sess.trajectory, "A session's trajectory"),
    RouteSpec("POST", "/v1/sessions/{session_id}/end", sess.end_session, "End a session with rewards", EndBody),
    RouteSpec("POST", "/update_weights", sess.update_weights, "Load new weights (admin)", UpdateWeightsBody),
    RouteSpec("POST", "/reload_weights", sess.reload_weights, "Back to the base weights as a new version (admin)"),
    RouteSpec("POST", "/pause", sess.pause, "No new turn until /resume; mode=abort aborts running ones", PauseBody),
    RouteSpec("POST", "/resume", sess.resume, "Resume generation (admin)"),
    RouteSpec("GET", "/v1/inspect/episodes", inspect.episodes, "The inspector: open and recently ended episodes",
              query=InspectQuery),
    RouteSpec("GET", "/v1/inspect/episodes/{episode_id}", inspect.episode,
              "The inspector: one episode token by token, its group and its session's branches"),
    RouteSpec("GET", "/v1/inspect/fleet", inspect.fleet, "The inspector: bridges, replicas, versions (admin)"),
    RouteSpec("GET", "/v1/inspect/events", inspect.events,
              "The inspector's live events (SSE with Accept: text/event-stream, else recent ones as JSON)",
              query=EventsQuery),
    RouteSpec("GET", "/health", sess.health, "200 while an engine replica is healthy", public=True),
    RouteSpec("GET", "/liveness", sess.liveness, "The process is up", public=True),
)  # fmt: skip


def create_app(
    bridge: Bridge,
    metrics: BridgeMetrics,
    tenants: dict[str, str],
    admin_tenants: list[str],
    *,
    session_ttl_s: float = 3600.0,
    max_body_bytes: int = 16 * 1024 * 1024,
    weights_changed: Callable[[str, int, bool, str, WeightProof | None], Awaitable[None]] | None = None,
) -> Starlette:
    """The front door over ``bridge`` (``tenants``: digest -> tenant from ``server.auth.load_tenants``;
    ``weights_changed``: see ``FrontDoor``)."""
    registry = SessionRegistry(bridge, session_ttl_s)
    door = FrontDoor(
        bridge,
        registry,
        Runner(bridge, registry, metrics),
        metrics,
        tenants,
        frozenset(admin_tenants),
        max_body_bytes,
        weights_changed,
    )
    schema = build(ROUTES, VERSION)

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    routes = [Route(r.path, endpoint(r.path, r.handler), methods=[r.method]) for r in ROUTES]
    routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    routes += [Route("/ui", inspect.page, methods=["GET"]), Route("/ui/{name}", inspect.page, methods=["GET"])]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: " + (
            "no such route" if status == 404 else "method not allowed"
        )
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return JSONResponse(body, status, headers=getattr(exc, "headers", None))  # a 405 names the Allow-ed methods

    async def bug(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: bug})
    app.state.door = door
    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the bridge owns the process's signals (server.app.serve)


class HttpFrontDoor:
    """The front door's uvicorn server: bound at construction, served as a task, stopped before the engines."""

    def __init__(self, app: Starlette, host: str, port: int, grace_s: float) -> None:
        self.app = app
        bind = host.strip("[]")
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.socket = socket.create_server((bind, port), family=family, reuse_port=False)
        # Accepted connections inherit it: a keep-alive call must not wait ~40 ms for a delayed ACK (uvicorn
        # writes a response's headers and body separately).
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=max(1, round(grace_s))
        )
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def door(self) -> Any:
        return self.app.state.door

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="http-front-door")
        while not self.server.started:
            if self._task.done():
                await self._task  # start-up failed: raise its error
                raise OSError(f"the HTTP front door on {self.host}:{self.port} stopped during start-up")
            await asyncio.sleep(0.01)
        log.info("HTTP front door on http://%s:%d (OpenAI and vLLM routes)", self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            self.socket.close()
            return
        self.server.should_exit = True
        await asyncio.wait([self._task])
        self._task = None
