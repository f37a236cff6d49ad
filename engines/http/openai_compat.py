"""Engines whose generation stream is OpenAI-compatible ``/v1/completions`` with token ids (vLLM, TRT-LLM).

One parser for both: each SSE chunk has at most one choice (``n=1``) with the generated ids in
``choices[0].token_ids``, their logprobs in ``choices[0].logprobs.token_logprobs`` and a finish reason;
a chunk without choices may carry ``usage`` (cached prompt tokens in
``usage.prompt_tokens_details.cached_tokens``). Anything else is a wire error naming the field.
A finish reason ``abort`` the bridge did not ask for (the server paused or is shutting down) raises
``Aborted``. Wire formats: ``../shared/reference/engine_api_contracts.md`` §1 (vLLM) and §3 (TRT-LLM).
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.errors import Aborted
from core.types import FinishReason, GenerateRequest, Usage
from engines.http.base import Delta, RemoteEngine, StreamState
from engines.http.wire import finish_from_openai


class OpenAICompletionsEngine(RemoteEngine):
    """``parse_event`` for OpenAI-compatible completion chunks, and the payload fields both servers share.

    Subclasses build their payload as ``completions_payload(request)`` plus their own fields (how they
    disable top-k, ask for logprobs and for token ids, salt the prefix cache).
    """

    missing_ids_hint: ClassVar[str] = "the server did not return token ids"

    def completions_payload(self, request: GenerateRequest) -> dict[str, Any]:
        """Token ids in, one streamed choice with usage out, sampled as ``request.params`` says."""
        p = request.params
        return {
            "model": self.served_model_name,
            "prompt": list(request.token_ids),
            "max_tokens": p.max_tokens,
            "n": 1,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "repetition_penalty": 1.0,
            "seed": p.seed,
            "stop": [],
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.ignore_eos,
            "min_tokens": 0,
            "echo": False,
            "skip_special_tokens": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def parse_event(self, data: Any, state: StreamState) -> Delta | None:
        w = self.wire
        body = w.obj(data, "chunk")
        usage = self.parse_usage(body.get("usage"))
        choices = w.list_(body.get("choices"), "choices")
        if not choices:
            return Delta([], [], None, usage) if usage is not None else None
        if len(choices) != 1:
            raise w.fail("choices", f"has {len(choices)} entries for a request with n=1")
        choice = w.obj(choices[0], "choices[0]")
        ids = self.token_ids(choice)
        logprobs: list[float] = []
        if ids:
            lp = w.obj(choice.get("logprobs"), "choices[0].logprobs")
            logprobs = w.logprobs(lp.get("token_logprobs"), "choices[0].logprobs.token_logprobs")
        if len(logprobs) != len(ids):
            raise w.fail("choices[0].logprobs.token_logprobs", f"has {len(logprobs)} entries for {len(ids)} token ids")
        finish = finish_from_openai(choice.get("finish_reason"), w, "choices[0].finish_reason")
        if finish == FinishReason.ABORT and not state.aborted:
            raise Aborted(f"{self.label} aborted the request (finish_reason 'abort'; paused or shutting down?)")
        return Delta(ids, logprobs, finish, usage)

    def token_ids(self, choice: dict[str, Any]) -> list[int]:
        """The generated ids of one chunk's choice (``choices[0].token_ids``, required)."""
        if choice.get("token_ids") is None:
            raise self.wire.fail("choices[0].token_ids", f"is missing: {self.missing_ids_hint}")
        return self.wire.ids(choice["token_ids"], "choices[0].token_ids")

    def parse_usage(self, value: Any) -> Usage | None:
        if value is None:
            return None
        w = self.wire
        u = w.obj(value, "usage")
        details = u.get("prompt_tokens_details")
        cached = 0
        if details is not None:
            d = w.obj(details, "usage.prompt_tokens_details")
            cached = w.optional_int(d.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens")
        return Usage(
            prompt_tokens=w.int_(u.get("prompt_tokens"), "usage.prompt_tokens"),
            cached_tokens=cached,
            generated_tokens=w.optional_int(u.get("completion_tokens"), "usage.completion_tokens"),
        )
