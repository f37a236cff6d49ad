"""A 422, not a 500, for an HTTP ``/step`` whose ``action.type`` is a JSON object or array.

openenv-core 0.3.0's ``deserialize_action`` looks ``action["type"]`` up in a dict of MCP action types before it
validates anything, so an unhashable value raises ``TypeError`` outside its ``ValidationError`` handler: a 500
(found by schemathesis in CI). Its ``/ws`` path catches every exception; only the HTTP route needs this. The
answer is openenv-core's own 422 body (pydantic's error list under ``detail``), so a client sees one format.

A pure ASGI middleware (not starlette's ``BaseHTTPMiddleware``): it reads a ``POST /step`` body once, answers
it, or hands the same bytes on; every other request passes untouched. Both OpenEnv apps use it
(``envhub.openenv.create_app``, ``llmserve.app.build_app``).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def unhashable_action_type(body: bytes) -> str | None:
    """The JSON kind of ``action.type`` when it is an object or array (what openenv-core cannot look up)."""
    try:
        data = json.loads(body)
    except ValueError:  # not JSON: FastAPI answers its own 422
        return None
    action = data.get("action") if isinstance(data, dict) else None
    kind = action.get("type") if isinstance(action, dict) else None
    if isinstance(kind, dict):
        return "object"
    if isinstance(kind, list):
        return "array"
    return None


class ActionTypeGuard:
    """Answers ``POST /step`` with ``action.type`` an object or array with 422 before openenv-core sees it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/step":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        kind = unhashable_action_type(body)
        if kind is not None:
            detail: list[dict[str, Any]] = [
                {
                    "type": "string_type",
                    "loc": ["body", "action", "type"],
                    "msg": f"action.type must be a string (an MCP action type or absent), not a JSON {kind}",
                }
            ]
            await JSONResponse({"detail": detail}, status_code=422)(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
