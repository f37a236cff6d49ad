"""``sglang``: adapter for an SGLang server's native ``/generate``, token ids in and out.

Wire format (``../shared/reference/engine_api_contracts.md`` §2): ``input_ids`` and a
``sampling_params`` object (seed named ``sampling_seed``), ``return_logprob`` with
``logprob_start_len = -1`` (output tokens only); every logprob is a ``[logprob, id, text]``
triple; the finish reason is an object (``{"type": "stop"|"length"|"abort", ...}``); stream
events are **cumulative** by default (each carries the whole output so far), deltas with
``--incremental-streaming-output`` (``sglang.incremental_streaming``).

Invariants
----------
* Every sampling knob is sent explicitly, with an explicit ``max_new_tokens`` (SGLang's
  default is 128) and ``no_stop_trim`` so a stop token stays in the ids.
* A cumulative event must extend what was seen (its ids start with the ids already
  yielded); each triple's id must equal the generated id at that position. Otherwise the
  response is malformed and the turn fails with ``EngineProtocolError``.
* ``null`` logprobs (orjson writes -inf as null) are -inf.
* Abort is ``POST /abort_request {rid}``: the stream then ends with an ``abort`` finish. An
  abort the bridge did not ask for is an ``Aborted`` error carrying SGLang's message.
* Weight updates go through ``/update_weights_from_disk`` with ``weight_version`` and a
  radix-cache flush; ``cache_salt`` is the request's ``core.salt.CacheSalt`` (re-versioned).
* LoRA adapters (``--enable-lora``): ``/load_lora_adapter`` / ``/unload_lora_adapter`` under our name per version
  (``AdapterRef.served``), a request naming it in ``lora_path``. SGLang cannot score a probe here, so an adapter
  version is not proven: an update with a proof is UNIMPLEMENTED.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from core.errors import Aborted, InvalidArgument, Unimplemented
from core.types import AdapterRef, Capability, FinishReason, GenerateRequest, Usage, WeightUpdate
from engines.config import SglangConfig
from engines.http.base import Delta, RemoteEngine, StreamState

log = logging.getLogger("primerl.engines")

CACHE_METRICS = ("sglang:cached_tokens_total", "sglang:prompt_tokens_total")


class SglangEngine(RemoteEngine):
    """One SGLang server (see module docstring)."""

    engine_name: ClassVar[str] = "sglang"
    # Statistics need ``--enable-metrics``.
    stat_counters: ClassVar[dict[str, str]] = dict(
        zip(CACHE_METRICS, ("engine_cached_tokens", "engine_prompt_tokens"), strict=True)
    )
    kv_usage_series: ClassVar[str] = "sglang:token_usage"
    generate_path: ClassVar[str] = "/generate"
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.MIN_P, Capability.WEIGHT_UPDATES, Capability.LORA}
    )
    config: SglangConfig

    def build_payload(self, request: GenerateRequest, salt: str) -> dict[str, Any]:
        p = request.params
        sampling: dict[str, Any] = {
            "max_new_tokens": p.max_tokens,
            "min_new_tokens": 0,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "min_p": p.min_p,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "stop": [],
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.ignore_eos,
            "n": 1,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        return {
            "input_ids": list(request.token_ids),
            "sampling_params": sampling,
            "rid": request.request_id,
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "return_text_in_logprobs": False,
            "cache_salt": salt,
            **({"lora_path": request.adapter.served} if request.adapter is not None else {}),
        }

    def parse_event(self, data: Any, state: StreamState) -> Delta | None:
        w = self.wire
        body = w.obj(data, "event")
        meta = w.obj(body.get("meta_info"), "meta_info")
        ids = w.ids(body.get("output_ids"), "output_ids")
        triples = w.list_(meta.get("output_token_logprobs"), "meta_info.output_token_logprobs")
        if len(triples) != len(ids):
            raise w.fail("meta_info.output_token_logprobs", f"has {len(triples)} entries for {len(ids)} output_ids")
        if self.config.incremental_streaming:
            start = 0
        else:
            if len(ids) < state.seen_tokens:
                raise w.fail(
                    "output_ids", f"shrank from {state.seen_tokens} to {len(ids)} tokens in a cumulative stream"
                )
            start = state.seen_tokens
        new_ids = ids[start:]
        logprobs: list[float] = []
        for i in range(start, len(ids)):
            where = f"meta_info.output_token_logprobs[{i}]"
            triple = w.list_(triples[i], where)
            if len(triple) < 2:
                raise w.fail(where, f"is {triple!r}, expected [logprob, token_id, text]")
            if w.int_(triple[1], f"{where}[1]") != ids[i]:
                raise w.fail(f"{where}[1]", f"is {triple[1]}, but output_ids[{i}] is {ids[i]}")
            logprobs.append(w.logprob(triple[0], f"{where}[0]"))
        state.seen_tokens += len(new_ids)
        finish = self._finish(meta.get("finish_reason"), state)
        usage = None
        if finish is not None:
            prompt = w.int_(meta.get("prompt_tokens"), "meta_info.prompt_tokens")
            usage = Usage(
                prompt_tokens=prompt,
                cached_tokens=w.optional_int(meta.get("cached_tokens"), "meta_info.cached_tokens"),
                generated_tokens=w.optional_int(
                    meta.get("completion_tokens"), "meta_info.completion_tokens", state.seen_tokens
                ),
            )
        return Delta(new_ids, logprobs, finish, usage)

    def _finish(self, value: Any, state: StreamState) -> FinishReason | None:
        if value is None:
            return None
        w = self.wire
        reason = w.obj(value, "meta_info.finish_reason")
        kind = reason.get("type")
        if kind == "stop":
            return FinishReason.STOP
        if kind == "length":
            return FinishReason.LENGTH
        if kind == "abort":
            if state.aborted:
                return FinishReason.ABORT
            raise Aborted(f"{self.label} aborted the request: {reason.get('message') or 'no reason given'}")
        raise w.fail("meta_info.finish_reason.type", f"is {kind!r}, expected stop, length or abort")

    async def send_abort(self, state: StreamState) -> None:
        await self.request("POST", "/abort_request", json_body={"rid": state.request.request_id, "abort_all": False})

    async def update_weights(self, update: WeightUpdate) -> None:
        """``/update_weights_from_disk`` with the new ``weight_version`` (and a cache flush)."""
        if not update.checkpoint_path:
            raise InvalidArgument("checkpoint_path is empty: name the directory SGLang should load")
        async with self.exclusive_update():  # no turn in flight while the weights change
            response = await self.request(
                "POST",
                "/update_weights_from_disk",
                json_body={
                    "model_path": update.checkpoint_path,
                    "abort_all_requests": False,
                    "weight_version": str(update.policy_version),
                    "flush_cache": self.config.flush_cache_on_update and not update.keep_kv,
                },
                timeout=self.config.weight_update_timeout_s,
            )
            body = self.wire.obj(self.wire.loads(response.text, "update_weights_from_disk"), "update_weights_from_disk")
            if body.get("success") is not True:
                raise InvalidArgument(f"{self.label} could not load {update.checkpoint_path!r}: {body.get('message')}")
            self._version = update.policy_version

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        """``POST /load_lora_adapter`` under the version's own name (SGLang started with ``--enable-lora``); a request
        names it in ``lora_path``."""
        body = {"lora_name": ref.served, "lora_path": path, "pinned": False}
        try:
            answer = await self._lora_call("/load_lora_adapter", body, f"load the adapter in {path!r}")
        except InvalidArgument as exc:
            if "already been loaded" in exc.message:  # (a replica back in rotation: ``Adapters.restore``)
                return
            raise
        if answer.get("success") is not True:
            raise InvalidArgument(f"{self.label} could not load the adapter in {path!r}: {answer.get('error_message')}")

    async def unload_adapter(self, ref: AdapterRef) -> None:
        await self._lora_call("/unload_lora_adapter", {"lora_name": ref.served}, f"unload {ref.served}")

    async def _lora_call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            response = await self.request("POST", path, json_body=body, timeout=self.config.weight_update_timeout_s)
        except InvalidArgument as exc:  # SGLang answers a failed load with 400 and its message
            raise InvalidArgument(f"{self.label} could not {what}: {exc.message}") from None
        except Unimplemented:
            raise Unimplemented(f"{self.label} has no {path} route: start SGLang with --enable-lora") from None
        return self.wire.obj(self.wire.loads(response.text, path), path)

    async def refresh_version(self) -> None:
        """``GET /get_weight_version``: "default" (its start-up weights) is version 0. A replica restarted after a
        weight update reports less than the adapter sent; the bridge then keeps it out of rotation."""
        body = self.wire.obj(await self.get_json("/get_weight_version"), "get_weight_version")
        reported = str(body.get("weight_version", ""))
        served = int(reported) if reported.isdigit() else 0
        if served != self._version:
            log.warning("%s serves weight version %r, not %d (restarted?)", self.label, reported, self._version)
            self._version = served

    async def cache_stats(self) -> dict[str, float]:
        """``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total`` (needs ``--enable-metrics``)."""
        return await self.prometheus(CACHE_METRICS)
