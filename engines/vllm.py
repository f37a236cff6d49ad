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
* ``cache_salt`` is derived from ``model@policy_version`` (hashed: vLLM rejects ``@``): vLLM
  keeps its prefix cache across a weight reload, and the salt keeps KV of old weights unused.
* A weight directory is checked locally before vLLM is asked to load it (a bad path kills
  the vLLM server); the reload itself is the dev-mode ``/collective_rpc reload_weights``.
* Abort = dropping the connection (vLLM aborts a request whose client went away).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path
from typing import Any, ClassVar

from engines.config import VllmConfig
from engines.http_base import Delta, RemoteEngine, StreamState
from engines.types import FinishReason, GenerateRequest, Usage, WeightUpdate
from engines.wire import finish_from_openai
from server.errors import Aborted, InvalidArgument, PrimeRLError, Unimplemented

_SAFE_SALT = re.compile(r"[A-Za-z0-9._:+-]+")
PREFIX_CACHE_METRICS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def vllm_salt(salt: str) -> str:
    """A ``cache_salt`` vLLM accepts: at most 128 characters, none of ``@ / \\`` or NUL, not empty.

    The bridge's salt (``model@policy_version``) contains ``@``, so anything outside
    ``[A-Za-z0-9._:+-]`` is replaced by a digest of the whole salt (distinct salts stay distinct).
    """
    if salt and len(salt) <= 128 and _SAFE_SALT.fullmatch(salt):
        return salt
    return "s-" + hashlib.sha256(salt.encode()).hexdigest()[:40]


def check_weight_dir(path: str) -> Path:
    """Raise InvalidArgument unless ``path`` is a directory with config.json and safetensors weights."""
    if not path:
        raise InvalidArgument("checkpoint_path is empty: name a directory with config.json and *.safetensors")
    d = Path(path)
    if not d.is_dir():
        raise InvalidArgument(f"checkpoint_path {path!r} is not a directory")
    if not (d / "config.json").is_file():
        raise InvalidArgument(f"checkpoint_path {path!r} has no config.json")
    if not any(d.glob("*.safetensors")):
        raise InvalidArgument(f"checkpoint_path {path!r} has no *.safetensors weights")
    return d


class VllmEngine(RemoteEngine):
    """One vLLM server (see module docstring)."""

    engine_name: ClassVar[str] = "vllm"
    generate_path: ClassVar[str] = "/v1/completions"
    supports_weight_updates: ClassVar[bool] = True
    config: VllmConfig

    def build_payload(self, request: GenerateRequest, salt: str) -> dict[str, Any]:
        p = request.params
        return {
            "model": self.served_model_name,
            "prompt": list(request.token_ids),
            "max_tokens": p.max_tokens,
            "n": 1,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "seed": p.seed,
            "stop": [],
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.ignore_eos,
            "min_tokens": 0,
            "logprobs": 0,  # 0 = the sampled token's logprob only
            "echo": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": vllm_salt(salt),
            "request_id": request.request_id,
        }

    def parse_event(self, data: Any, state: StreamState) -> Delta | None:
        w = self.wire
        body = w.obj(data, "chunk")
        usage = self._usage(body.get("usage"))
        choices = w.list_(body.get("choices"), "choices")
        if not choices:
            return Delta([], [], None, usage) if usage is not None else None
        if len(choices) != 1:
            raise w.fail("choices", f"has {len(choices)} entries for a request with n=1")
        choice = w.obj(choices[0], "choices[0]")
        ids = self._token_ids(choice)
        lp = choice.get("logprobs")
        logprobs = (
            w.logprobs(w.obj(lp, "choices[0].logprobs").get("token_logprobs"), "choices[0].logprobs.token_logprobs")
            if ids
            else []
        )
        if len(logprobs) != len(ids):
            raise w.fail("choices[0].logprobs.token_logprobs", f"has {len(logprobs)} entries for {len(ids)} token ids")
        finish = finish_from_openai(choice.get("finish_reason"), w, "choices[0].finish_reason")
        if finish == FinishReason.ABORT and not state.aborted:
            raise Aborted(f"{self.label} aborted the request (finish_reason 'abort'; paused or shutting down?)")
        return Delta(ids, logprobs, finish, usage)

    def _token_ids(self, choice: dict[str, Any]) -> list[int]:
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

    def _usage(self, value: Any) -> Usage | None:
        if value is None:
            return None
        w = self.wire
        u = w.obj(value, "usage")
        details = u.get("prompt_tokens_details")
        cached = 0
        if details is not None:
            cached = w.optional_int(
                w.obj(details, "usage.prompt_tokens_details").get("cached_tokens"),
                "usage.prompt_tokens_details.cached_tokens",
            )
        return Usage(
            prompt_tokens=w.int_(u.get("prompt_tokens"), "usage.prompt_tokens"),
            cached_tokens=cached,
            generated_tokens=w.optional_int(u.get("completion_tokens"), "usage.completion_tokens"),
        )

    async def update_weights(self, update: WeightUpdate) -> None:
        """Reload weights from a directory through vLLM's dev-mode ``/collective_rpc``."""
        path = update.checkpoint_path
        if self.config.validate_weight_dir:
            path = str(check_weight_dir(path).resolve())
        async with self.exclusive_update():  # no turn in flight while the weights change
            try:
                await self.request(
                    "POST",
                    "/collective_rpc",
                    json_body={
                        "method": "reload_weights",
                        "kwargs": {"weights_path": path},
                        "timeout": self.config.weight_update_timeout_s,
                    },
                    timeout=self.config.weight_update_timeout_s,
                )
            except Unimplemented:
                raise Unimplemented(
                    f"{self.label} has no /collective_rpc endpoint: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                    "(`primerl engine launch vllm` does) to allow weight reloads"
                ) from None
            self._version = update.policy_version
            if self.config.reset_prefix_cache_on_update and not update.keep_kv:
                # Only frees memory: the cache salt already keeps old KV from being used.
                with contextlib.suppress(PrimeRLError):
                    await self.request("POST", "/reset_prefix_cache")

    async def refresh_stats(self) -> None:
        """Prefix-cache counters and KV usage into ``counters.extra`` (read by the bridge's /metrics)."""
        stats = await self.prometheus((*PREFIX_CACHE_METRICS, "vllm:kv_cache_usage_perc"))
        extra = self.counters.extra
        for name, key in zip(PREFIX_CACHE_METRICS, ("prefix_cache_hits", "prefix_cache_queries"), strict=True):
            if name in stats:
                extra[key] = int(stats[name])
        if "vllm:kv_cache_usage_perc" in stats:
            extra["kv_usage_ppm"] = int(stats["vllm:kv_cache_usage_perc"] * 1e6)

    async def prefix_cache_stats(self) -> dict[str, float]:
        """``vllm:prefix_cache_{hits,queries}_total`` (in tokens) from ``/metrics``."""
        return await self.prometheus(PREFIX_CACHE_METRICS)
