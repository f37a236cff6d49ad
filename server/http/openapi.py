"""``GET /openapi.json``: the front door's routes, built from the route table and the body models' JSON schema."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.http.context import Handler

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
ERRORS = {
    "400": "malformed body or bad field (error.param names it)",
    "401": "missing or invalid bearer token",
    "403": "not allowed (admin routes; a session key used for another session)",
    "404": "unknown session or episode (or the inspector is off)",
    "409": "the session has a call in progress",
    "413": "body too large",
    "429": "admission limit reached (Retry-After)",
    "501": "not implemented by the engines",
    "503": "no engine replica available",
}


@dataclass(frozen=True)
class RouteSpec:
    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | None = None
    session_header: bool = False
    public: bool = False  # no bearer token needed
    query: type[BaseModel] | None = None  # the query string's parameters (a 400 names an unknown or bad one)


def _operation(spec: RouteSpec, refs: dict[Any, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": spec.summary, "operationId": spec.handler.__name__}
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", spec.path)
    ]
    if spec.query is not None:
        props = spec.query.model_json_schema()["properties"]
        params += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in props.items()]
    if spec.session_header:
        params.append({"name": "X-Session-ID", "in": "header", "required": False, "schema": {"type": "string"}})
    if params:
        op["parameters"] = params
    if spec.body is not None:
        schema = refs[(spec.body, "validation")]
        required = any(f.is_required() for f in spec.body.model_fields.values())  # else an empty body is {}
        op["requestBody"] = {"required": required, "content": {"application/json": {"schema": schema}}}
    ok = "201" if spec.path == "/v1/sessions" else "200"
    op["responses"] = {ok: {"description": "success", "content": {"application/json": {"schema": {"type": "object"}}}}}
    if spec.path == "/health":
        op["responses"] = {"200": {"description": "healthy"}, "503": {"description": "no healthy replica"}}
        return op
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for status, why in ERRORS.items():
        op["responses"][status] = {"description": why, **error}
    if not spec.public:
        op["security"] = [{"bearer": []}]
    return op


def build(routes: Sequence[RouteSpec], version: str) -> dict[str, Any]:
    models = sorted({r.body for r in routes if r.body is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for spec in routes:
        paths.setdefault(spec.path, {})[spec.method.lower()] = _operation(spec, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "PrimeRL-ServeKit HTTP front door", "version": version},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
