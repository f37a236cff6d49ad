"""The verifier's HTTP JSON surface (Starlette, served by uvicorn); binary values are base64.

==========================================  ==================================================================
``POST /v1/score``                          ``{"grader", "trajectory", "params"}`` -> ``{"reward", "receipt"}``
``POST /v1/score/batch``                    ``{"items": [...]}`` -> ``{"results": [{"reward", "receipt"} |
                                            {"error": {"code", "message"}}]}`` (per-item outcome)
``GET /v1/log/checkpoint``                  ``{"origin", "tree_size", "root_hash", "note"}``
``GET /v1/log/entries/{index}``             ``{"leaf", "envelope"}``
``GET /v1/log/proof/inclusion``             ``?index=I&tree_size=N`` -> ``{"index", "tree_size", "hashes"}``
``GET /v1/log/proof/consistency``           ``?first=M&second=N`` -> ``{"first", "second", "hashes"}``
``GET /v1/keys``                            ``{"origin", "keys": [{"keyid", "public_key", "vkey", ...}]}``
==========================================  ==================================================================

Errors are ``{"error": {"code", "message", "fields"?}}`` with 400 for bad input (``fields`` names each
bad field, e.g. ``trajectory.logprobs``), 404 for an unknown entry or route, 409 when the verifier cannot
serve it as it is (no ``--bridge``, a log that contradicts itself), 422 for a grader that failed, 504 for a
grader past its deadline, 503 when the database refused an append: ``code`` is the error's gRPC code and
the status its class's HTTP status (the one map of ``core.errors``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import PrimeRLError
from core.errors_http import json_error
from verifier.service import BatchRequest, ScoreRequest, Verifier, summary, validation_fields


class _Inclusion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = Field(ge=0)
    tree_size: int = Field(ge=1)


class _Consistency(BaseModel):
    model_config = ConfigDict(extra="forbid")
    first: int = Field(ge=0)
    second: int = Field(ge=0)


def _error(status: int, code: str, message: str, fields: list[dict[str, str]] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if fields is not None:
        body["fields"] = fields
    return JSONResponse({"error": body}, status_code=status)


async def _primerl_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, PrimeRLError)
    return json_error(exc, {"error": {"code": exc.code, "message": exc.message}})


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    message, fields = validation_fields(exc)
    return _error(400, "INVALID_ARGUMENT", message, fields)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, "NOT_FOUND" if exc.status_code == 404 else "INVALID_ARGUMENT", str(exc.detail))


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise HTTPException(400, f"body: not JSON ({exc})") from exc


def create_app(verifier: Verifier) -> Starlette:
    log = verifier.log

    async def score(request: Request) -> Response:
        result = await verifier.score(ScoreRequest.model_validate(await _body(request)))
        return JSONResponse(result.to_json())

    async def score_batch(request: Request) -> Response:
        batch = BatchRequest.model_validate(await _body(request))
        if len(batch.items) > verifier.config.max_batch_items:
            raise HTTPException(400, f"items: {len(batch.items)} items, more than {verifier.config.max_batch_items}")
        return JSONResponse({"results": summary(await verifier.score_batch(batch.items))})

    async def checkpoint(_: Request) -> Response:
        return JSONResponse(log.checkpoint())

    async def entry(request: Request) -> Response:
        raw = request.path_params["index"]
        if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone admits '²', which int() refuses
            raise HTTPException(400, f"index: {raw!r} is not a non-negative integer")
        return JSONResponse(await verifier.read(log.entry, int(raw)))

    async def inclusion(request: Request) -> Response:
        q = _Inclusion.model_validate(dict(request.query_params))
        hashes = log.inclusion_proof(q.index, q.tree_size)
        return JSONResponse({"index": q.index, "tree_size": q.tree_size, "hashes": hashes})

    async def consistency(request: Request) -> Response:
        q = _Consistency.model_validate(dict(request.query_params))
        return JSONResponse({"first": q.first, "second": q.second, "hashes": log.consistency_proof(q.first, q.second)})

    async def keys(_: Request) -> Response:
        return JSONResponse(log.key_list())

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok", "tree_size": log.size})

    routes = [
        Route("/v1/score", score, methods=["POST"]),
        Route("/v1/score/batch", score_batch, methods=["POST"]),
        Route("/v1/log/checkpoint", checkpoint),
        Route("/v1/log/entries/{index}", entry),
        Route("/v1/log/proof/inclusion", inclusion),
        Route("/v1/log/proof/consistency", consistency),
        Route("/v1/keys", keys),
        Route("/healthz", healthz),
    ]
    handlers = {PrimeRLError: _primerl_error, ValidationError: _validation_error, HTTPException: _http_error}
    return Starlette(routes=routes, exception_handlers=handlers)
