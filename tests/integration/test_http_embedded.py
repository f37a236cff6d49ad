"""Acceptance of the HTTP front door on the embedded SmolLM2 engine, with the official ``openai`` SDK.

3-turn chat sessions (plain, streamed, with tools, all with ``return_token_ids``): the exported trajectory
equals, token for token, the prompt and completion ids and the logprobs the SDK received; SmolLM2's
template renders append-only (0 forks); turns 2-3 prefill only their new tokens (engine counters). An
``n=8`` call is one GRPO group: one prompt prefill and 8 member sessions with trajectories.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from engines.launch import free_port
from server.app import BridgeServer, create_server
from server.config import load_settings

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served() -> AsyncIterator[tuple[BridgeServer, openai.AsyncOpenAI]]:
    settings = load_settings(
        engine={"type": "embedded", "embedded": {"max_model_len": 1024}},
        server={"port": 0, "grace_period_s": 1.0},
        metrics={"port": 0},
        http={"port": free_port()},
    )
    server = await create_server(settings)
    await server.start()
    sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="EMPTY", max_retries=0)
    yield server, sdk
    await sdk.close()
    await server.stop(0.5)


async def _turn(sdk: openai.AsyncOpenAI, sid: str, messages: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One chat call; returns what the SDK received: prompt ids, completion ids, logprobs, the message."""
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    kw |= dict(extra_body={"return_token_ids": True}, extra_headers={"X-Session-ID": sid})
    if mode == "tools":
        kw["tools"] = TOOLS
    if mode != "streamed":
        r = await sdk.chat.completions.create(**kw)
        c = r.choices[0]
        message = c.message.model_dump(exclude_none=True)
        lps = [e.logprob for e in c.logprobs.content] if c.logprobs and c.logprobs.content else []
        return {"prompt": r.prompt_token_ids, "ids": c.token_ids, "lps": lps, "message": message}  # type: ignore[attr-defined]
    got: dict[str, Any] = {"prompt": None, "ids": [], "lps": [], "text": ""}
    async for chunk in await sdk.chat.completions.create(stream=True, **kw):
        got["prompt"] = got["prompt"] or (chunk.model_extra or {}).get("prompt_token_ids")
        for ch in chunk.choices:
            got["text"] += ch.delta.content or ""
            got["ids"] += (ch.model_extra or {}).get("token_ids") or []
            got["lps"] += [e.logprob for e in ch.logprobs.content] if ch.logprobs and ch.logprobs.content else []
    got["message"] = {"role": "assistant", "content": got["text"]}
    return got


@pytest.mark.parametrize("mode", ["plain", "streamed", "tools"])
async def test_three_turn_sessions_export_exactly_what_the_sdk_received(served: Any, mode: str) -> None:
    server, sdk = served
    engine = server.bridge.engines[0]
    forks = server.metrics.http_forks.labels("chat")._value.get()
    sid = f"accept-{mode}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    history, lps = 0, []
    for turn in range(3):
        before = engine.counters.prefill_tokens
        got = await _turn(sdk, sid, messages, mode)
        prefilled = engine.counters.prefill_tokens - before
        assert len(got["ids"]) == len(got["lps"]) > 0
        if turn:  # only the new messages were rendered and prefilled (the last sampled token is decode work)
            assert prefilled == len(got["prompt"]) - history
        history = len(got["prompt"]) + len(got["ids"])
        lps += got["lps"]
        messages.append(got["message"])
        for call in got["message"].get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18}'})
        messages.append({"role": "user", "content": f"Thanks. And tomorrow ({turn})?"})
        last = got
    traj = (await sdk._client.get(f"{sdk.base_url}sessions/{sid}/trajectory")).json()
    assert traj["token_ids"] == last["prompt"] + last["ids"]
    assert [lp for lp, m in zip(traj["logprobs"], traj["loss_mask"], strict=True) if m] == lps
    assert traj["forks"] == 0 and traj["metadata"]["http.forks"] == "0" and len(traj["turns"]) == 3
    assert server.metrics.http_forks.labels("chat")._value.get() == forks


async def test_n8_is_one_group_with_one_prompt_prefill(served: Any) -> None:
    server, sdk = served
    engine = server.bridge.engines[0]
    before = engine.counters.prefill_tokens
    r = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a random number between 1 and 100."}],
        n=8,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"return_token_ids": True},
    )
    prompt = r.prompt_token_ids  # type: ignore[attr-defined]
    assert engine.counters.prefill_tokens - before == len(prompt)
    members = r.model_extra["session_ids"]
    assert len(members) == len(r.choices) == 8
    for member, choice in zip(members, r.choices, strict=True):
        traj = (await sdk._client.get(f"{sdk.base_url}sessions/{member}/trajectory")).json()
        assert traj["token_ids"] == prompt + choice.token_ids  # type: ignore[attr-defined]
