"""vLLM's token route, ``POST /inference/v1/generate``, as prime-rl and verifiers call it.

Body ``{"model"?, "token_ids", "sampling_params": {...}, "stream"?, "cache_salt"?, "request_id"?}``; the
session is ``X-Session-ID`` (created on first use). Response as vLLM's ``GenerateResponse``::

    {"request_id", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token": "token_id:<id>",
     "logprob", "bytes", "top_logprobs": []}]} | null, "finish_reason"}], "usage", "prompt_logprobs": null,
     "kv_transfer_params": null}

``logprobs`` is present when ``sampling_params.logprobs`` is set (any value: each entry is the sampled
token's logprob, finite; alternatives are not reported). ``prompt_token_ids`` is not returned (verifiers
would take it as the prompt; omitting it is what vLLM does). ``cache_salt`` is accepted and unused: the
bridge salts every prefix-cache key with the tenant and policy version itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.context import SESSION_HEADER, FrontDoor
from server.http.errors import error_body
from server.http.models import GenerateBody
from server.http.params import stops, vllm_sampling
from server.http.render import logprob_content
from server.http.runner import Call, Choice, total_usage
from server.requestid import current_request_id


async def generate(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, GenerateBody)
    caller = door.caller(request)
    overrides, params = vllm_sampling(body.sampling_params)
    session = await door.session(request, caller)
    call = Call("generate", overrides, params.n, ids=body.token_ids, model=body.model or "",
                stops=stops(params.stop, "sampling_params.stop"))  # fmt: skip
    choices = await door.runner.begin(session, call)
    rid = body.request_id or current_request_id.get()
    with_logprobs = params.logprobs is not None
    headers = {SESSION_HEADER: session.id}
    chunks = _Chunks(door, choices, rid, with_logprobs) if body.stream else None
    if streamed := await door.runner.respond(session, choices, call.stops, chunks, headers):
        return streamed
    for c in choices:
        if c.error is not None:
            raise c.error
    out: dict[str, Any] = {
        "request_id": rid,
        "choices": [_choice(door, c, c.token_ids, c.logprobs, c.finish_reason, with_logprobs) for c in choices],
        "usage": total_usage(choices),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    if len(choices) > 1:
        out["session_ids"] = [c.session.id for c in choices]
    return JSONResponse(out, headers=headers)


def _choice(
    door: FrontDoor, c: Choice, ids: list[int], lps: list[float], finish: str | None, with_logprobs: bool
) -> dict[str, Any]:
    logprobs = {"content": logprob_content(door.bridge.tokenizer, ids, lps, True)} if with_logprobs else None
    return {"index": c.index, "token_ids": list(ids), "logprobs": logprobs, "finish_reason": finish}


class _Chunks:
    """Streamed ``GenerateStreamResponse`` events (delta token ids per event)."""

    def __init__(self, door: FrontDoor, choices: list[Choice], rid: str, with_logprobs: bool) -> None:
        self.door, self.choices, self.rid, self.with_logprobs = door, choices, rid, with_logprobs
        self.sent = [0] * len(choices)

    def __call__(self, index: int, count: int | None) -> Iterable[dict[str, Any]]:
        c = self.choices[index]
        if c.error is not None and count is None:
            yield error_body(c.error)[1]
            return
        k, self.sent[index] = self.sent[index], len(c.token_ids)
        finish = c.finish_reason if count is None else None
        choice = _choice(self.door, c, c.token_ids[k:], c.logprobs[k:], finish, self.with_logprobs)
        if choice["token_ids"] or finish is not None:
            yield {"request_id": self.rid, "choices": [choice]}

    def tail(self) -> Iterable[dict[str, Any]]:
        yield {"request_id": self.rid, "choices": [], "usage": total_usage(self.choices)}
