"""OpenAI routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each call runs on a session (``X-Session-ID``, a session key, or a one-call session whose id comes back
in the ``X-Session-ID`` header) through ``server.http.runner``. Wire formats follow OpenAI, with vLLM's
extensions: ``return_token_ids`` (``prompt_token_ids`` and ``choices[i].token_ids``) and
``return_tokens_as_token_ids``. Logprobs are the sampled token's, under the distribution it was sampled
from; alternatives (``top_logprobs`` > 0, completions ``logprobs`` > 0) are refused with a 400, because
the engines report only the sampled token. ``n`` > 1 samples a GRPO group: one prompt prefill, one
member session per choice (``session_ids``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.context import SESSION_HEADER, Caller, FrontDoor
from server.http.errors import BadParam, error_body
from server.http.models import ChatBody, CompletionBody
from server.http.params import openai_sampling, stops
from server.http.render import (
    assistant_message,
    check_tool_choice,
    completion_logprobs,
    logprob_content,
    tool_schemas,
    visible_text,
)
from server.http.runner import Call, Choice, total_usage
from server.http.sessions import Session


class Progress:
    """What a stream has sent of each choice (tokens and text)."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices = choices
        self.ids = [0] * len(choices)
        self.text = [""] * len(choices)
        self.started = [False] * len(choices)

    def take(self, index: int) -> tuple[list[int], list[float]]:
        c, k = self.choices[index], self.ids[index]
        self.ids[index] = len(c.token_ids)
        return c.token_ids[k:], c.logprobs[k:]

    def text_delta(self, index: int, text: str) -> str:
        sent = self.text[index]
        if not text.startswith(sent):
            return ""
        self.text[index] = text
        return text[len(sent) :]


def _served_model(door: FrontDoor, model: str | None) -> str:
    """The response's ``model``: the adapter's name when the call named a loaded LoRA adapter (as vLLM answers),
    else the base model."""
    return model if model and door.bridge.adapters.known(model) else door.bridge.info.model


def _n(body: ChatBody | CompletionBody, session: Session) -> int:
    return body.n if "n" in body.model_fields_set or session.started else session.group_size


def _extras(choices: list[Choice]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if len(choices) > 1:
        out["session_ids"] = [c.session.id for c in choices]
    return out


def _raise_first_error(choices: list[Choice]) -> None:
    for c in choices:
        if c.error is not None:
            raise c.error


# -- chat -----------------------------------------------------------------------------


async def chat_completions(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, ChatBody)
    caller = door.caller(request)
    if body.top_logprobs:
        raise BadParam(
            "top_logprobs",
            "top_logprobs must be 0: the bridge's engines report only the sampled token's logprob, not alternatives",
        )
    tools = tool_schemas(body.tools)
    session = await door.session(request, caller, tools=tools)
    parse = check_tool_choice(body.tool_choice, bool(tools or session.tools))
    max_tokens = body.max_completion_tokens or body.max_tokens
    call = Call("chat", openai_sampling(body, max_tokens), _n(body, session), messages=body.messages, tools=tools,
                model=body.model or "", stops=stops(body.stop))  # fmt: skip
    choices = await door.runner.begin(session, call)

    def on_done(done: list[Choice]) -> None:
        for c in done:
            c.message, back = assistant_message(door.runner.text(c), parse)
            c.session.messages = [*body.messages, back]

    head = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "created": int(time.time()),
        "model": _served_model(door, body.model),
    }
    headers = {SESSION_HEADER: session.id}
    chunks = _ChatChunks(door, body, choices, head, parse) if body.stream else None
    if streamed := await door.runner.respond(session, choices, call.stops, chunks, headers, on_done):
        return streamed
    _raise_first_error(choices)
    out = {**head, "object": "chat.completion", "choices": [_chat_choice(door, body, c) for c in choices]}
    out["usage"] = total_usage(choices)
    if body.return_token_ids:
        out["prompt_token_ids"] = choices[0].prompt_ids
    return JSONResponse(out | _extras(choices), headers=headers)


def _finish(c: Choice, message: dict[str, Any] | None) -> str:
    if message is not None and message.get("tool_calls") and c.finish_reason != "length":
        return "tool_calls"
    return c.finish_reason


def _chat_choice(door: FrontDoor, body: ChatBody, c: Choice) -> dict[str, Any]:
    tok, as_ids = door.bridge.tokenizer, body.return_tokens_as_token_ids
    out: dict[str, Any] = {
        "index": c.index,
        "message": c.message,
        "logprobs": {"content": logprob_content(tok, c.token_ids, c.logprobs, as_ids)} if body.logprobs else None,
        "finish_reason": _finish(c, c.message),
        "stop_reason": c.stop_hit,
    }
    if body.return_token_ids:
        out["token_ids"] = list(c.token_ids)
    return out


class _ChatChunks:
    """``chat.completion.chunk`` events of a streamed chat call."""

    def __init__(self, door: FrontDoor, body: ChatBody, choices: list[Choice], head: dict[str, Any], parse: bool):
        self.door, self.body, self.choices, self.parse = door, body, choices, parse
        self.head = {**head, "object": "chat.completion.chunk"}
        self.progress = Progress(choices)

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**self.head, "choices": [choice], **extra}

    def __call__(self, index: int, count: int | None) -> Iterable[dict[str, Any]]:
        c, p = self.choices[index], self.progress
        if c.error is not None and count is None:
            yield error_body(c.error)[1]
            return
        extra: dict[str, Any] = {}
        delta: dict[str, Any] = {}
        if not p.started[index]:
            p.started[index] = True
            delta["role"] = "assistant"
            if self.body.return_token_ids:
                extra["prompt_token_ids"] = c.prompt_ids
        ids, lps = p.take(index)
        final = count is None
        text = (c.message or {}).get("content") or "" if final else visible_text(self.door.runner.text(c), self.parse)
        delta["content"] = p.text_delta(index, text)
        if final and c.message is not None and c.message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c.message["tool_calls"])]
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if self.body.logprobs and ids:
            tok = self.door.bridge.tokenizer
            choice["logprobs"] = {"content": logprob_content(tok, ids, lps, self.body.return_tokens_as_token_ids)}
        if self.body.return_token_ids:
            choice["token_ids"] = ids
        if final:
            choice["finish_reason"] = _finish(c, c.message)
        if ids or final or delta.get("role") or delta["content"]:
            yield self._chunk(choice, **extra)

    def tail(self) -> Iterable[dict[str, Any]]:
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield {**self.head, "choices": [], "usage": total_usage(self.choices)}


# -- completions ----------------------------------------------------------------------


def _prompt_ids(door: FrontDoor, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise BadParam("prompt", "one prompt per call (a session is one history); use n for several samples")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if door.bridge.tokenizer is None:
            raise BadParam("prompt", f"engine {door.bridge.info.engine!r} has no tokenizer: send token ids")
        ids = door.bridge.tokenizer.encode(prompt)
    else:
        ids = [int(x) for x in prompt]  # type: ignore[arg-type]
    if not ids:
        raise BadParam("prompt", "the prompt is empty")
    return ids


async def completions(request: Request, door: FrontDoor) -> Response:
    body = await door.body(request, CompletionBody)
    caller: Caller = door.caller(request)
    if body.echo:
        raise BadParam("echo", "echo is not supported; use return_token_ids to get the prompt's token ids")
    if body.logprobs:
        raise BadParam(
            "logprobs",
            "logprobs must be 0 or null: the bridge's engines report only the sampled token's logprob, "
            "not alternatives",
        )
    ids = _prompt_ids(door, body.prompt)
    session = await door.session(request, caller)
    call = Call("completions", openai_sampling(body), _n(body, session), ids=ids, model=body.model or "",
                stops=stops(body.stop))  # fmt: skip
    choices = await door.runner.begin(session, call)
    head = {
        "id": "cmpl-" + secrets.token_hex(12),
        "created": int(time.time()),
        "model": _served_model(door, body.model),
    }
    headers = {SESSION_HEADER: session.id}
    chunks = _CompletionChunks(door, body, choices, head) if body.stream else None
    if streamed := await door.runner.respond(session, choices, call.stops, chunks, headers):
        return streamed
    _raise_first_error(choices)
    out = {**head, "object": "text_completion", "choices": [_completion_choice(door, body, c) for c in choices]}
    out["usage"] = total_usage(choices)
    return JSONResponse(out | _extras(choices), headers=headers)


def _completion_choice(door: FrontDoor, body: CompletionBody, c: Choice) -> dict[str, Any]:
    tok = door.bridge.tokenizer
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tok, c.token_ids, c.logprobs, body.return_tokens_as_token_ids)
    out = {
        "index": c.index,
        "text": visible_text(door.runner.text(c), False) if c.stop_hit is None else door.runner.text(c),
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_hit,
    }
    if body.return_token_ids:
        out["token_ids"] = list(c.token_ids)
        out["prompt_token_ids"] = c.prompt_ids
    return out


class _CompletionChunks:
    """``text_completion`` events of a streamed completions call."""

    def __init__(self, door: FrontDoor, body: CompletionBody, choices: list[Choice], head: dict[str, Any]):
        self.door, self.body, self.choices = door, body, choices
        self.head = {**head, "object": "text_completion"}
        self.progress = Progress(choices)

    def __call__(self, index: int, count: int | None) -> Iterable[dict[str, Any]]:
        c, p = self.choices[index], self.progress
        if c.error is not None and count is None:
            yield error_body(c.error)[1]
            return
        ids, lps = p.take(index)
        final = count is None
        text = self.door.runner.text(c)
        delta = p.text_delta(index, text if final and c.stop_hit else visible_text(text, False))
        choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
        if self.body.logprobs is not None and ids:
            tok = self.door.bridge.tokenizer
            choice["logprobs"] = completion_logprobs(tok, ids, lps, self.body.return_tokens_as_token_ids)
        if self.body.return_token_ids:
            choice["token_ids"] = ids
            if not p.started[index]:
                choice["prompt_token_ids"] = c.prompt_ids
        p.started[index] = True
        if final:
            choice["finish_reason"] = c.finish_reason
        if ids or final or delta:
            yield {**self.head, "choices": [choice]}

    def tail(self) -> Iterable[dict[str, Any]]:
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield {**self.head, "choices": [], "usage": total_usage(self.choices)}


# -- models ---------------------------------------------------------------------------


async def models(request: Request, door: FrontDoor) -> Response:
    door.caller(request)
    info = door.bridge.info
    card = {
        "id": info.model,
        "object": "model",
        "created": 0,
        "owned_by": "primerl",
        "root": info.model,
        "parent": None,
        "max_model_len": info.max_model_len,
        "permission": [],
    }
    # LoRA adapters as vLLM lists them: a model whose parent is the base; a call names one as its model.
    loras = [{**card, "id": name, "parent": info.model} for name in door.bridge.adapters.versions()]
    return JSONResponse({"object": "list", "data": [card, *loras]})
