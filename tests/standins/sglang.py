"""SGLang stand-in: the native ``/generate`` API and its ops endpoints, backed by any ``Engine``.

Follows ``../shared/reference/engine_api_contracts.md`` §2, quirks included:

* ``input_ids`` + ``sampling_params`` (a dict whose unknown keys are rejected, as SGLang's
  ``SamplingParams(**dict)`` does); the seed is ``sampling_seed``; ``max_new_tokens`` defaults
  to 128; ``top_k = -1`` means all; ``temperature = 0`` is greedy.
* Every logprob is a ``[logprob, token_id, text|null]`` triple (text only with
  ``return_text_in_logprobs``); -inf is written as ``null`` (orjson); with
  ``logprob_start_len = -1`` ``input_token_logprobs`` holds one entry, the last prompt
  token, with a null logprob.
* ``finish_reason`` is ``{"type":"stop","matched":id}``, ``{"type":"length","length":N}``,
  ``{"type":"abort","message":...}`` or ``null`` while running.
* Streams are **cumulative** (``text``, ``output_ids`` and logprob arrays are the whole output
  so far) unless the server runs with incremental streaming; they end with ``data: [DONE]``.
* ``n > 1`` turns one request into n: the non-streamed answer is a JSON **array** and a string
  ``rid`` becomes ``{rid}_{i}``; stream events carry ``index``.
* Without ``no_stop_trim`` the matched stop token is trimmed from ``output_ids`` and ``text``
  (the stand-in's reading of SGLang's stop trimming; the adapter always sends ``no_stop_trim``).
* ``meta_info`` carries extra keys (``weight_version``, ``e2e_latency``) that clients must ignore.
* Errors: HTTP 400 ``{"error":{"message":...}}``; inside a stream ``data: {"error":...}``.
* LoRA (``--enable-lora``: ``lora=True``): ``POST /load_lora_adapter {lora_name, lora_path, pinned}`` and
  ``/unload_lora_adapter {lora_name}`` answer ``{"success", "error_message", "loaded_adapters"}`` (400 on failure);
  ``/generate`` names a loaded adapter in ``lora_path``. The backing engine serves it (the embedded engine: peft
  adapters).

Limits of the stand-in (rejected with HTTP 400 naming the field): ``text``/``input_embeds``
prompts without a tokenizer, batched ``input_ids``, ``top_logprobs_num > 0``, and sampling
knobs the backing engine cannot honour (penalties, stop strings, grammars) unless
they are neutral.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from core.errors import PrimeRLError
from core.types import AdapterRef, FinishReason, GenerateRequest, SamplingParams, WeightUpdate
from engines.base import Engine
from tests.standins._common import (
    Faults,
    StandinServer,
    decode,
    error_json,
    generate,
    keepalive_stall,
    null_if_inf,
    sse,
)

TOP_LEVEL_KEYS = frozenset(
    [
        "input_ids",
        "text",
        "input_embeds",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
        "stream",
        "rid",
        "session_params",
        "lora_path",
        "priority",
        "cache_salt",
        "extra_key",
        "return_prompt_token_ids",
        "return_hidden_states",
        "return_routed_experts",
        "custom_logit_processor",
    ]
)
SAMPLING_KEYS = frozenset(
    [
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "custom_params",
        "n",
        "sampling_seed",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
    ]
)
# Knobs the backing engine cannot honour: accepted only at their neutral value.
NEUTRAL: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
}


class BadRequest(Exception):
    pass


@dataclass
class SglangStandin:
    """An SGLang server in front of ``engine`` (see module docstring)."""

    engine: Engine
    served_model_name: str = "default"
    model_path: str = "/models/standin"
    incremental_streaming: bool = False
    faults: Faults = field(default_factory=Faults)
    weight_version: str = "default"
    cached_tokens_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    running: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every /generate body received (tests inspect what the adapter sent)."""
    arrivals: list[float] = field(default_factory=list)
    """``time.monotonic()`` when each of ``requests`` arrived."""
    received: list[GenerateRequest] = field(default_factory=list)
    """Every request handed to the backing engine (with the ``cache_salt`` the wire carried)."""
    weight_updates: list[dict[str, Any]] = field(default_factory=list)
    """Every /update_weights_from_disk body, plus ``running``: generations running when it arrived."""
    flushes: list[str] = field(default_factory=list)
    """Each radix-cache flush done, by what asked for it (``update_weights_from_disk`` or ``flush_cache``)."""
    lora: bool = False
    """Started with ``--enable-lora``: the LoRA routes load adapters into the backing engine."""
    loras: dict[str, str] = field(default_factory=dict)
    """Loaded LoRA adapters: name -> path."""
    _rids: dict[str, list[str]] = field(default_factory=dict)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST", "PUT"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/health_generate", self.health, methods=["GET"]),
                Route("/ping", self.ping, methods=["GET"]),
                Route("/get_model_info", self.model_info, methods=["GET"]),
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/abort_request", self.abort_request, methods=["POST"]),
                Route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"]),
                Route("/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
                Route("/get_weight_version", self.get_weight_version, methods=["GET"]),
                Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ]
        )

    async def serve(self) -> StandinServer:
        server = StandinServer(self.app())
        await server.start()
        return server

    # -- /generate ------------------------------------------------------------------------------

    def _params(self, sp: dict[str, Any], prompt_len: int) -> tuple[SamplingParams, dict[str, Any]]:
        for key in sp:
            if key not in SAMPLING_KEYS:
                raise BadRequest(f"Unknown sampling parameter {key!r}")
        for key, neutral in NEUTRAL.items():
            value = sp.get(key, neutral)
            if value is not None and value != neutral and value != []:
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by this stand-in")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        room = self.engine.info.max_model_len - prompt_len
        if room <= 0:
            raise BadRequest(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.engine.info.max_model_len} tokens)."
            )
        temperature = float(sp.get("temperature", 1.0))
        top_k = int(sp.get("top_k", -1))
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}")
        seed = sp.get("sampling_seed")
        try:
            params = SamplingParams(
                temperature=temperature,
                top_p=float(sp.get("top_p", 1.0)),
                top_k=0 if top_k == -1 else top_k,
                min_p=float(sp.get("min_p", 0.0)),
                max_tokens=max(min(max_new, room), 1),
                stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
                seed=None if seed is None else int(seed),
                ignore_eos=bool(sp.get("ignore_eos", False)),
            )
            params.validate(self.engine.info.vocab_size)
        except (PrimeRLError, TypeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        options = {
            "n": int(sp.get("n", 1)),
            "no_stop_trim": bool(sp.get("no_stop_trim", False)),
            "max_new": max_new,
        }
        if options["n"] < 1:
            raise BadRequest(f"n must be >= 1, got {options['n']}")
        return params, options

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            if ids and isinstance(ids[0], list):
                raise BadRequest("batched input_ids are not supported by this stand-in")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("input_ids must be a list of integers")
            vocab = self.engine.info.vocab_size
            for t in ids:
                if not 0 <= t < vocab:
                    raise BadRequest(f"Input token id {t} is out of vocabulary (vocab size {vocab}).")
            return list(ids)
        if isinstance(body.get("text"), str) and self.engine.tokenizer is not None:
            return self.engine.tokenizer.encode(body["text"])
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")

    async def generate(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_json("request body is not valid JSON")
        if not isinstance(body, dict):
            return error_json("request body must be a JSON object")
        self.requests.append(body)
        self.arrivals.append(time.monotonic())
        try:
            for key in body:
                if key not in TOP_LEVEL_KEYS:
                    raise BadRequest(f"GenerateReqInput got an unexpected keyword argument {key!r}")
            ids = self._prompt(body)
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise BadRequest("sampling_params must be an object")
            params, options = self._params(sp, len(ids))
            if int(body.get("top_logprobs_num") or 0) > 0:
                raise BadRequest("top_logprobs_num > 0 is not supported by this stand-in")
            lora = body.get("lora_path")
            if lora is not None and (not self.lora or lora not in self.loras):
                why = "LoRA is not enabled (--enable-lora)" if not self.lora else f"loaded: {sorted(self.loras)}"
                raise BadRequest(f"LoRA adapter {lora!r} is not loaded; {why}")
            options["adapter"] = AdapterRef(lora, 0) if lora is not None else None
        except BadRequest as exc:
            return error_json(str(exc))
        if self.faults.first_byte_delay_s:
            await asyncio.sleep(self.faults.first_byte_delay_s)
        n = options["n"]
        rid = body.get("rid")
        base_rid = rid if isinstance(rid, str) and rid else f"standin-{time.monotonic_ns()}"
        rids = [base_rid] if n == 1 else [f"{base_rid}_{i}" for i in range(n)]
        self._rids[base_rid] = rids
        salt = body.get("cache_salt")
        options["cache_salt"] = salt if isinstance(salt, str) else ""
        logprob = bool(body.get("return_logprob", False))
        text_lp = bool(body.get("return_text_in_logprobs", False))
        started = time.perf_counter()
        if body.get("stream"):
            return StreamingResponse(
                self._stream(ids, params, options, rids, base_rid, logprob, text_lp, started),
                media_type="text/event-stream",
            )
        outs = []
        try:
            for i, r in enumerate(rids):
                member = params if params.seed is None else _reseed(params, params.seed + i)
                final: dict[str, Any] = {}
                async for event in self._events(ids, member, options, r, logprob, text_lp, started, False):
                    final = event
                outs.append(final)
        finally:
            self._rids.pop(base_rid, None)
        return JSONResponse(outs[0] if n == 1 else outs)

    async def _stream(
        self,
        ids: list[int],
        params: SamplingParams,
        options: dict[str, Any],
        rids: list[str],
        base_rid: str,
        logprob: bool,
        text_lp: bool,
        started: float,
    ) -> AsyncIterator[bytes]:
        sent = 0
        try:
            if self.faults.keepalive_stall_s:
                async for comment in keepalive_stall(self.faults):
                    yield comment
            for i, r in enumerate(rids):
                member = params if params.seed is None else _reseed(params, params.seed + i)
                async for event in self._events(ids, member, options, r, logprob, text_lp, started, True):
                    if len(rids) > 1:
                        event["index"] = i
                    sent = (
                        len(event["output_ids"]) if not self.incremental_streaming else sent + len(event["output_ids"])
                    )
                    if self.faults.drop_after_tokens is not None and sent >= self.faults.drop_after_tokens:
                        raise ConnectionAbortedError("stand-in fault: engine died mid-stream")
                    if self.faults.malformed == "json":
                        yield b"data: {not json\n\n"
                        continue
                    if self.faults.malformed == "field" and event["output_ids"]:
                        event["output_ids"][0] = str(event["output_ids"][0])
                    yield sse(event)
        except BadRequest as exc:
            yield sse({"error": {"message": str(exc)}})
        finally:
            self._rids.pop(base_rid, None)
        yield sse("[DONE]")

    async def _events(
        self,
        ids: list[int],
        params: SamplingParams,
        options: dict[str, Any],
        rid: str,
        logprob: bool,
        text_lp: bool,
        started: float,
        streaming: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """Events of one sequence: cumulative (or deltas when incremental), the last one finished."""
        out_ids: list[int] = []
        out_lps: list[float] = []
        emitted = 0
        self.running += 1
        try:
            salt = options.get("cache_salt", "")
            adapter = options.get("adapter")
            chunks = generate(self.engine, ids, params, rid, cache_salt=salt, received=self.received, adapter=adapter)
            async for chunk in chunks:
                out_ids.extend(chunk.token_ids)
                out_lps.extend(chunk.logprobs)
                finish: dict[str, Any] | None = None
                cached = 0
                if chunk.finish_reason is not None:
                    cached = chunk.usage.cached_tokens if chunk.usage else 0
                    finish = self._finish(chunk.finish_reason, out_ids, params, options)
                    if finish.get("type") == "stop" and not options["no_stop_trim"] and out_ids:
                        out_ids, out_lps = out_ids[:-1], out_lps[:-1]
                    self.prompt_tokens_total += len(ids)
                    self.cached_tokens_total += cached
                    self.generation_tokens_total += len(out_ids)
                elif not streaming or not chunk.token_ids:
                    continue
                lo = emitted if (self.incremental_streaming and streaming) else 0
                event_ids = out_ids[lo:]
                meta: dict[str, Any] = {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": len(ids),
                    "weight_version": self.weight_version,
                    "completion_tokens": len(out_ids),
                    "cached_tokens": cached,
                    "e2e_latency": round(time.perf_counter() - started, 6),
                }
                if logprob:
                    meta["input_token_logprobs"] = [[None, ids[-1], decode(self.engine, ids[-1:]) if text_lp else None]]
                    meta["output_token_logprobs"] = [
                        [null_if_inf(lp), t, decode(self.engine, [t]) if text_lp else None]
                        for lp, t in zip(out_lps[lo:], event_ids, strict=True)
                    ]
                    meta["input_top_logprobs"] = [None]
                    meta["output_top_logprobs"] = [None] * len(event_ids)
                emitted = len(out_ids)
                yield {"text": decode(self.engine, event_ids), "output_ids": list(event_ids), "meta_info": meta}
        finally:
            self.running -= 1

    @staticmethod
    def _finish(
        reason: FinishReason, out_ids: list[int], params: SamplingParams, options: dict[str, Any]
    ) -> dict[str, Any]:
        if reason == FinishReason.STOP:
            return {"type": "stop", "matched": out_ids[-1] if out_ids else None}
        if reason == FinishReason.LENGTH:
            return {"type": "length", "length": len(out_ids)}
        return {"type": "abort", "message": "Abort in waiting queue", "status_code": 499}

    # -- ops ------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        await asyncio.sleep(self.faults.health_delay_s)
        if self.faults.unhealthy:
            return Response(status_code=503)
        return Response(status_code=200)

    async def ping(self, request: Request) -> Response:
        return PlainTextResponse("")

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }
        )

    async def server_info(self, request: Request) -> Response:
        return JSONResponse(
            {"model_path": self.model_path, "context_length": self.engine.info.max_model_len, "version": "standin"}
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": self.served_model_name,
                        "max_model_len": self.engine.info.max_model_len,
                    }
                ],
            }
        )

    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        targets = (
            [r for rids in self._rids.values() for r in rids]
            if body.get("abort_all")
            else self._rids.get(str(body.get("rid")), [])
        )
        for r in targets:
            await self.engine.abort(r)
        return Response(status_code=200)

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await request.json()
        self.weight_updates.append({**body, "running": self.running})
        path = body.get("model_path")
        if not isinstance(path, str) or not await asyncio.to_thread(Path(path).exists):
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update weights: {path!r} does not exist.",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        version = body.get("weight_version")
        current = self.engine.policy_version
        numeric = int(version) if isinstance(version, str) and version.isdigit() else current + 1
        await self.engine.update_weights(WeightUpdate(path, numeric))
        if version is not None:
            self.weight_version = str(version)
        if body.get("flush_cache", True):  # SGLang's default: flush the radix cache after loading
            self.flushes.append("update_weights_from_disk")
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not self.lora:
            return error_json("LoRA is not enabled: start the server with --enable-lora", 400)
        if not isinstance(name, str) or not name or not isinstance(path, str):
            return self._lora_answer(False, "lora_name and lora_path are required", 400)
        if name in self.loras:
            return self._lora_answer(False, f"The LoRA adapter {name!r} has already been loaded", 400)
        try:
            await self.engine.load_adapter(AdapterRef(name, 0), path)  # type: ignore[attr-defined]
        except PrimeRLError as exc:
            return self._lora_answer(False, f"Failed to load LoRA adapter {name!r}: {exc.message}", 400)
        self.loras[name] = path
        return self._lora_answer(True, "")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await request.json()
        name = body.get("lora_name")
        if name not in self.loras:
            return self._lora_answer(False, f"LoRA adapter {name!r} is not loaded", 400)
        await self.engine.unload_adapter(AdapterRef(name, 0))  # type: ignore[attr-defined]
        del self.loras[name]
        return self._lora_answer(True, "")

    def _lora_answer(self, success: bool, message: str, status: int = 200) -> Response:
        answer = {"success": success, "error_message": message, "loaded_adapters": dict(self.loras)}
        return JSONResponse(answer, status_code=status)

    async def get_weight_version(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.weight_version})

    async def flush_cache(self, request: Request) -> Response:
        if self.running:
            return PlainTextResponse("Cache not flushed: there are running or waiting requests.", status_code=400)
        self.flushes.append("flush_cache")
        return PlainTextResponse("Cache flushed.")

    async def metrics(self, request: Request) -> Response:
        name = self.served_model_name
        lines = [
            "# TYPE sglang:cached_tokens_total counter",
            f'sglang:cached_tokens_total{{model_name="{name}",cache_source="device"}} {self.cached_tokens_total:.1f}',
            "# TYPE sglang:prompt_tokens_total counter",
            f'sglang:prompt_tokens_total{{model_name="{name}"}} {float(self.prompt_tokens_total)}',
            "# TYPE sglang:generation_tokens_total counter",
            f'sglang:generation_tokens_total{{model_name="{name}"}} {float(self.generation_tokens_total)}',
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{model_name="{name}"}} {float(self.running)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _reseed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed % 2**63)
