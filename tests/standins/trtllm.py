"""TensorRT-LLM stand-in: ``trtllm-serve``'s ``/v1/completions`` and ops endpoints, backed by any ``Engine``.

Follows ``../shared/reference/engine_api_contracts.md`` §3, quirks included:

* Validation is strict (``extra="forbid"``): an unknown field (``return_token_ids``,
  ``cache_salt``, ``prompt_logprobs``, ...) gets the request rejected with HTTP 400; ``model``
  is required.
* Generated ids are returned only with ``"detokenize": false`` (then ``text`` is ``""``); with
  the default ``detokenize: true`` ``token_ids`` is ``null``.
* Logprobs only when ``logprobs`` is truthy (``logprobs: 0`` returns none); ``tokens`` are
  decoded strings (no token-id mode); ``top_logprobs`` is ``[]`` (the backend returns plain
  floats); -inf is clamped to ``-9999.0``.
* ``usage.prompt_tokens_details.cached_tokens`` is always present.
* Streams carry deltas; a usage-only chunk follows when ``stream_options.include_usage``;
  then ``data: [DONE]``. An error mid-stream is ``data: {"error":{...}}`` then ``[DONE]``.
* ``priority`` is a float in [0, 1]; ``max_tokens`` defaults to unbounded (the context window).
* Abort is a client disconnect only; ``/metrics`` is JSON iteration stats, not Prometheus;
  ``/update_weights`` takes CUDA IPC handles, which cannot be opened here (HTTP 400).

Limits of the stand-in (HTTP 400 naming the field): string prompts without a tokenizer, and
knobs the backing engine cannot honour (penalties, stop strings, logit bias,
``response_format``) unless neutral.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.errors import PrimeRLError
from core.types import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from engines.base import Engine
from tests.standins._common import Faults, StandinServer, clamp_inf, decode, generate, sse


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class CompletionRequest(BaseModel):
    """The accepted fields of trtllm-serve's ``CompletionRequest`` (anything else is rejected)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: list[int] | list[list[int]] | str | list[str]
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = 1.0
    top_p: float | None = None
    user: str | None = None
    # sampling extensions
    top_k: int | None = None
    top_p_min: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    early_stopping: bool | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    # other
    return_context_logits: bool = False
    detokenize: bool = True
    thinking_token_budget: int | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    priority: float | None = Field(None, ge=0.0, le=1.0)
    lora_request: dict[str, Any] | None = None
    disaggregated_params: dict[str, Any] | None = None
    conversation_params: dict[str, Any] | None = None


def bad_request(message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400},
        status_code=400,
    )


class BadRequest(Exception):
    pass


@dataclass
class TrtllmStandin:
    """A trtllm-serve server in front of ``engine`` (see module docstring)."""

    engine: Engine
    served_model_name: str = "standin"
    faults: Faults = field(default_factory=Faults)
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every /v1/completions body received (tests inspect what the adapter sent)."""
    received: list[GenerateRequest] = field(default_factory=list)
    """Every request handed to the backing engine (no salt: trtllm-serve has no ``cache_salt``)."""
    iterations: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/health_generate", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/server_info", self.server_info, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/update_weights", self.update_weights, methods=["POST"]),
            ]
        )

    async def serve(self) -> StandinServer:
        server = StandinServer(self.app())
        await server.start()
        return server

    # -- /v1/completions --------------------------------------------------------------------------

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], str)):
            if self.engine.tokenizer is None:
                raise BadRequest("string prompts need a tokenizer; this stand-in's engine has none")
            texts = [p] if isinstance(p, str) else p
            return [self.engine.tokenizer.encode(str(t)) for t in texts]
        prompts = [list(x) for x in p] if p and isinstance(p[0], list) else [list(p)]  # type: ignore[arg-type]
        vocab = self.engine.info.vocab_size
        for ids in prompts:
            if not ids:
                raise BadRequest("prompt is empty")
            for t in ids:
                if not isinstance(t, int) or not 0 <= t < vocab:
                    raise BadRequest(f"Token id {t} is out of vocabulary (vocab size {vocab})")
        return prompts

    def _params(self, req: CompletionRequest, prompt_len: int) -> SamplingParams:
        neutral = {
            "frequency_penalty": (req.frequency_penalty, 0.0),
            "presence_penalty": (req.presence_penalty, 0.0),
            "repetition_penalty": (req.repetition_penalty, 1.0),
            "min_tokens": (req.min_tokens, 0),
            "echo": (req.echo, False),
            "top_p_min": (req.top_p_min, None),
            "logit_bias": (req.logit_bias, None),
            "response_format": (req.response_format, None),
            "best_of": (req.best_of, None),
        }
        for name, (value, default) in neutral.items():
            if value is not None and value != default and not (name == "best_of" and value == req.n):
                raise BadRequest(f"{name}={value!r} is not supported by this stand-in")
        if req.stop not in (None, [], ""):
            raise BadRequest("stop strings are not supported with this stand-in")
        if req.logprobs is not None and req.logprobs > 1:
            raise BadRequest("logprobs > 1 requires the pytorch backend or gather_generation_logits")
        room = self.engine.info.max_model_len - prompt_len
        if room <= 0:
            raise BadRequest(
                f"The prompt length ({prompt_len}) exceeds the max_seq_len ({self.engine.info.max_model_len})"
            )
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {req.max_tokens}")
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                max_tokens=max_tokens,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                seed=req.seed,
                ignore_eos=req.ignore_eos,
            )
            params.validate(self.engine.info.vocab_size)
        except PrimeRLError as exc:
            raise BadRequest(exc.message) from None
        return params

    async def completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return bad_request("request body is not valid JSON")
        self.requests.append(body if isinstance(body, dict) else {})
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            return bad_request(str(exc))
        try:
            prompts = self._prompts(req)
            params = [self._params(req, len(p)) for p in prompts]
        except BadRequest as exc:
            return bad_request(str(exc))
        if self.faults.first_byte_delay_s:
            await asyncio.sleep(self.faults.first_byte_delay_s)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        jobs = [
            (pi * req.n + j, prompt, p if p.seed is None else replace(p, seed=(p.seed + j) % 2**63))
            for pi, (prompt, p) in enumerate(zip(prompts, params, strict=True))
            for j in range(req.n)
        ]
        if req.stream:
            return StreamingResponse(self._stream(req, cid, created, jobs), media_type="text/event-stream")
        choices = []
        prompt_tokens = cached = completion = 0
        for index, prompt, p in jobs:
            chunks = [c async for c in generate(self.engine, prompt, p, f"{cid}-{index}", received=self.received)]
            ids = [t for c in chunks for t in c.token_ids]
            lps = [lp for c in chunks for lp in c.logprobs]
            last = chunks[-1]
            choices.append(self._choice(req, index, ids, lps, last.finish_reason))
            prompt_tokens += len(prompt) if index % req.n == 0 else 0
            cached += last.usage.cached_tokens if last.usage and index % req.n == 0 else 0
            completion += len(ids)
        self.iterations += 1
        return Response(
            _dumps(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": req.model,
                    "choices": choices,
                    "usage": _usage(prompt_tokens, completion, cached),
                    "prompt_token_ids": None,
                }
            ),
            media_type="application/json",
        )

    def _choice(
        self, req: CompletionRequest, index: int, ids: list[int], lps: list[float], finish: FinishReason | None
    ) -> dict[str, Any]:
        logprobs = None
        if req.logprobs:
            tokens = [decode(self.engine, [t]) for t in ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": [clamp_inf(x) for x in lps],
                "tokens": tokens,
                "top_logprobs": [],
            }
        reason = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
        return {
            "index": index,
            "text": "" if not req.detokenize else decode(self.engine, ids),
            "token_ids": list(ids) if not req.detokenize else None,
            "logprobs": logprobs,
            "context_logits": None,
            "finish_reason": reason[finish] if finish is not None else None,
            "stop_reason": ids[-1] if finish == FinishReason.STOP and ids else None,
            "disaggregated_params": None,
            "avg_decoded_tokens_per_iter": None,
        }

    async def _stream(
        self, req: CompletionRequest, cid: str, created: int, jobs: list[tuple[int, list[int], SamplingParams]]
    ) -> AsyncIterator[bytes]:
        head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
        prompt_tokens = cached = completion = 0
        try:
            for index, prompt, p in jobs:
                chunk: TokenChunk
                async for chunk in generate(self.engine, prompt, p, f"{cid}-{index}", received=self.received):
                    if not chunk.token_ids and chunk.finish_reason is None:
                        continue
                    completion += len(chunk.token_ids)
                    if self.faults.drop_after_tokens is not None and completion >= self.faults.drop_after_tokens:
                        raise ConnectionAbortedError("stand-in fault: engine died mid-stream")
                    choice = self._choice(req, index, list(chunk.token_ids), list(chunk.logprobs), chunk.finish_reason)
                    if self.faults.malformed == "field" and choice["token_ids"]:
                        choice["token_ids"][0] = str(choice["token_ids"][0])
                    if self.faults.malformed == "json":
                        yield b"data: {not json\n\n"
                        continue
                    yield sse({**head, "choices": [choice], "usage": None})
                    if chunk.finish_reason is not None and index % req.n == 0:
                        prompt_tokens += len(prompt)
                        cached += chunk.usage.cached_tokens if chunk.usage else 0
            if req.stream_options is None or req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion, cached)})
        except BadRequest as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error", "code": None, "param": None}})
        self.iterations += 1
        yield sse("[DONE]")

    # -- ops --------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.faults.unhealthy else 200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": "standin"})

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tensorrt_llm",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def server_info(self, request: Request) -> Response:
        return JSONResponse({"disaggregated_params": None})

    async def metrics(self, request: Request) -> Response:
        stats = [{"iter": self.iterations, "numActiveRequests": 0, "kvCacheStats": {"reusedBlocks": 0}}]
        return JSONResponse(stats)

    async def update_weights(self, request: Request) -> Response:
        return bad_request("update_weights needs CUDA IPC handles from a process on this node; none can be opened here")


def _usage(prompt_tokens: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _dumps(data: Any) -> bytes:
    import json

    return json.dumps(data, allow_nan=False).encode()
