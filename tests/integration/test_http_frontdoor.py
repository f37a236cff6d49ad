"""The HTTP front door against a real bridge (toy engine) on free ports: the official ``openai`` SDK and httpx.

What a user of the routes would notice: sessions continue episodes append-only and count every fork; the
exported trajectory is exactly what the client received; every documented error is OpenAI's error JSON
with its status; the admin routes and the one-call sessions behave as documented.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from engines.launch import free_port
from rl_client import AsyncBridgeClient
from server.app import BridgeServer
from server.auth import hash_token
from tests.conftest import StartBridge

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "ops": "tok-ops"}


async def _open(start_bridge: StartBridge, **overrides: Any) -> tuple[BridgeServer, AsyncBridgeClient, str]:
    http = overrides.pop("http", {})
    server, client = await start_bridge(http={"port": free_port(), **http}, **overrides)
    return server, client, f"http://127.0.0.1:{server.http_port}"


@pytest.fixture
async def front(start_bridge: StartBridge) -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient, httpx.AsyncClient]]:
    server, client, base = await _open(start_bridge)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        yield server, client, http


@pytest.fixture
async def authed(start_bridge: StartBridge) -> AsyncIterator[tuple[BridgeServer, str]]:
    entries = [f"{t}:{hash_token(v)}" for t, v in TOKENS.items()]
    server, _, base = await _open(
        start_bridge,
        auth={"token_hashes": entries, "admin_tenants": ["ops"]},
        engine={"type": "toy", "toy": {"supports_weight_updates": True}},
    )
    yield server, base


def _session(server: BridgeServer, sid: str) -> Any:
    assert server.http is not None
    return server.http.door.registry.find("", sid)


def _forks(server: BridgeServer, route: str) -> float:
    return server.metrics.http_forks.labels(route)._value.get()


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    return err


async def test_token_route_extends_the_session_and_counts_a_fork(front: Any) -> None:
    server, _, http = front
    h = {"X-Session-ID": "rollout-1"}
    sp = {"max_tokens": 5, "temperature": 1.0, "logprobs": 1, "skip_special_tokens": False, "made_up_knob": 3}
    r1 = await http.post(
        "/inference/v1/generate", json={"model": "toy", "token_ids": [5, 6, 7], "sampling_params": sp}, headers=h
    )
    assert r1.status_code == 200 and r1.headers["x-session-id"] == "rollout-1"
    c1 = r1.json()["choices"][0]
    assert [e["token"] for e in c1["logprobs"]["content"]] == [f"token_id:{t}" for t in c1["token_ids"]]
    assert "prompt_token_ids" not in r1.json()
    turn2 = [5, 6, 7, *c1["token_ids"], 8, 9]
    r2 = await http.post("/inference/v1/generate", json={"token_ids": turn2, "sampling_params": sp}, headers=h)
    c2 = r2.json()["choices"][0]
    traj = (await http.get("/v1/sessions/rollout-1/trajectory")).json()
    assert traj["token_ids"] == turn2 + c2["token_ids"]
    assert traj["origins"][len(turn2) - 2 : len(turn2)] == ["env", "env"]
    sampled = [lp for lp, m in zip(traj["logprobs"], traj["loss_mask"], strict=True) if m]
    assert sampled == [e["logprob"] for e in c1["logprobs"]["content"] + c2["logprobs"]["content"]]
    assert traj["forks"] == 0 and traj["metadata"]["http.forks"] == "0" and _forks(server, "generate") == 0
    # A history that does not extend the session: a new branch, counted; the old one is kept, not spliced.
    r3 = await http.post("/inference/v1/generate", json={"token_ids": [5, 6, 1], "sampling_params": sp}, headers=h)
    assert r3.status_code == 200
    traj = (await http.get("/v1/sessions/rollout-1/trajectory")).json()
    assert traj["token_ids"][:3] == [5, 6, 1] and traj["origins"][:3] == ["prompt"] * 3
    assert traj["forks"] == 1 and traj["metadata"]["http.forks"] == "1" and _forks(server, "generate") == 1
    assert traj["metadata"]["http.fork_common_tokens"] == "2"
    assert traj["branches"][0]["token_ids"] == turn2 + c2["token_ids"]
    ended = (await http.post("/v1/sessions/rollout-1/end", json={"rewards": [1.5]})).json()
    assert ended["rewards"] == [1.5] and len(ended["branches"]) == 1
    assert (await http.get("/v1/sessions/rollout-1/trajectory")).json() == ended


async def test_openai_sdk_chat_three_turns_plain_and_streamed_match_the_trajectory(front: Any) -> None:
    server, _, http = front
    sdk = openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="EMPTY", max_retries=0)
    async with sdk:
        await _three_turn_chats(server, http, sdk)


async def _three_turn_chats(server: BridgeServer, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
    for streamed in (False, True):
        sid = f"chat-{streamed}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello there"}]
        received: list[int] = []
        prompt: list[int] = []
        for turn in range(3):
            kw: dict[str, Any] = dict(model="toy", messages=messages, max_tokens=6, seed=turn, logprobs=True)
            kw |= dict(extra_body={"return_token_ids": True}, extra_headers={"X-Session-ID": sid})
            if streamed:
                stream = await sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
                text, ids, first = "", [], None
                async for chunk in stream:
                    first = first or chunk.model_extra.get("prompt_token_ids")
                    for ch in chunk.choices:
                        text += ch.delta.content or ""
                        ids += ch.model_extra.get("token_ids") or []
                prompt, content = first, text
            else:
                resp = await sdk.chat.completions.create(**kw)
                ids, content = resp.choices[0].token_ids, resp.choices[0].message.content  # type: ignore[attr-defined]
                prompt = resp.prompt_token_ids  # type: ignore[attr-defined]
                lps = [e.logprob for e in resp.choices[0].logprobs.content]
                assert len(lps) == len(ids)
            assert prompt[: len(received)] == received  # append-only: the history the client saw, then new
            received = prompt + ids
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"More {turn}"}]
        traj = (await http.get(f"/v1/sessions/{sid}/trajectory")).json()
        assert traj["token_ids"] == received and traj["forks"] == 0 and len(traj["turns"]) == 3
    assert _forks(server, "chat") == 0


async def test_n_samples_one_group_with_a_session_per_member(front: Any) -> None:
    server, _, http = front
    engine = server.bridge.engines[0]
    before = engine.counters.requests
    r = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Pick"}], "n": 4, "max_tokens": 4, "seed": 3},
    )
    body = r.json()
    assert r.status_code == 200 and len(body["choices"]) == 4 and engine.counters.requests - before == 4
    members = body["session_ids"]
    assert members == [f"{r.headers['x-session-id']}.{i}" for i in range(4)]
    group = (await http.get(f"/v1/sessions/{r.headers['x-session-id']}/trajectory")).json()
    assert len({t["group_id"] for t in group["trajectories"]}) == 1
    assert len({tuple(t["token_ids"]) for t in group["trajectories"]}) > 1  # members sample on their own seeds
    # A member continues on its own session; the group's id refuses a second call.
    msgs = [{"role": "user", "content": "Pick"}, body["choices"][1]["message"], {"role": "user", "content": "Again"}]
    r2 = await http.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, headers={"X-Session-ID": members[1]}
    )
    assert r2.status_code == 200
    assert (await http.get(f"/v1/sessions/{members[1]}/trajectory")).json()["forks"] == 0
    again = await http.post(
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 3},
        headers={"X-Session-ID": r.headers["x-session-id"]},
    )
    assert _error(again, 400)["param"] == "X-Session-ID"
    ended = (await http.post(f"/v1/sessions/{r.headers['x-session-id']}/end", json={"rewards": [1, 0, 0, 1]})).json()
    assert [t["rewards"] for t in ended["trajectories"]] == [[1.0], [0.0], [0.0], [1.0]]


async def test_one_call_session_completions_stop_strings_and_tools(front: Any) -> None:
    _, _, http = front
    r = await http.post("/v1/completions", json={"prompt": "the", "max_tokens": 8, "return_token_ids": True, "seed": 1})
    sid = r.headers["x-session-id"]
    assert r.status_code == 200 and sid.startswith("sess-")
    traj = (await http.get(f"/v1/sessions/{sid}/trajectory")).json()
    choice = r.json()["choices"][0]
    assert traj["token_ids"] == choice["prompt_token_ids"] + choice["token_ids"]
    words = choice["text"].split()
    stop = words[1] if len(words) > 1 else words[0]
    s = await http.post("/v1/completions", json={"prompt": "the", "max_tokens": 8, "seed": 1, "stop": [stop]})
    assert s.json()["choices"][0]["finish_reason"] == "stop" and stop not in s.json()["choices"][0]["text"]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    t = await http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 3}
    )
    assert t.status_code == 200
    bad = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"},
    )
    assert _error(bad, 400)["param"] == "tool_choice"


async def test_stop_strings_across_tokens_and_updates_decode_each_token_a_bounded_number_of_times(
    start_bridge: StartBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One token per update (yield_every=1): the choice's text grows by a word per update.
    server, _, base = await _open(start_bridge, engine={"type": "toy", "toy": {"yield_every": 1}})
    tok = server.bridge.tokenizer
    decoded: list[int] = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids: decoded.append(len(ids)) or decode(ids))
    body = {"prompt": "the", "max_tokens": 300, "seed": 3, "ignore_eos": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        full = (await http.post("/v1/completions", json=body | {"stop": ["no such words"]})).json()["choices"][0]
        n = len(full["token_ids"])
        assert n == 300 and full["finish_reason"] == "length"
        # Stop matching decoded what each update added, not the whole choice again (300 * 301 / 2 ids before).
        assert sum(decoded) <= 20 * n, sum(decoded)
        text = full["text"]
        words = text.split()
        late = len(" ".join(words[:250]))  # a stop string that straddles two tokens (and so two updates)
        for stop in [text[late - 2 : late + 3], words[200][-1] + " " + words[201]]:
            r = (await http.post("/v1/completions", json=body | {"stop": ["no such words", stop]})).json()
            # What decoding the whole choice on every update found: the first match, the text before it.
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == text[: text.find(stop)]


async def test_models_health_liveness_openapi(front: Any) -> None:
    server, _, http = front
    models = (await http.get("/v1/models")).json()
    assert models["data"][0]["id"] == "toy" and models["data"][0]["max_model_len"] == server.bridge.info.max_model_len
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/liveness")).json() == {"status": "ok"}
    spec = (await http.get("/openapi.json")).json()
    assert {"/inference/v1/generate", "/v1/chat/completions", "/v1/completions", "/v1/sessions", "/update_weights",
            "/v1/sessions/{session_id}/trajectory"} <= set(spec["paths"])  # fmt: skip
    assert "ChatBody" in spec["components"]["schemas"]


async def test_bad_input_is_a_400_naming_the_field(front: Any) -> None:
    _, _, http = front
    x = [{"role": "user", "content": "x"}]
    cases: list[tuple[str, Any, str]] = [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": x, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": x, "temperature": 2.2e-309}, "temperature"),  # found by the fuzzer: 500
        ("/v1/chat/completions", {"messages": x, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": x, "presence_penalty": 1}, "presence_penalty"),
        ("/v1/completions", {"prompt": [[1], [2]]}, "prompt"),
        ("/v1/completions", {"prompt": [1], "logprobs": 2}, "logprobs"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ("/inference/v1/generate", {"sampling_params": {}}, "token_ids"),
        ("/v1/sessions", {"group_size": 0}, "group_size"),
    ]
    for path, body, param in cases:
        assert _error(await http.post(path, json=body), 400)["param"] == param, (path, body)
    assert _error(await http.post("/v1/chat/completions", content=b"{not json"), 400)["param"] == "body"
    err = _error(await http.post("/inference/v1/generate", json={"token_ids": [10**9]}), 400)
    assert "vocabulary" in err["message"]
    assert _error(await http.get("/no/such/route"), 404)["type"] == "not_found_error"


async def test_errors_of_auth_tenants_limits_and_admin(authed: Any, start_bridge: StartBridge) -> None:
    server, base = authed
    bearer = {k: {"Authorization": f"Bearer {v}"} for k, v in TOKENS.items()}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
        assert _error(await http.post("/inference/v1/generate", json=gen), 401)["type"] == "authentication_error"
        _error(await http.post("/inference/v1/generate", json=gen, headers={"Authorization": "Bearer nope"}), 401)
        ok = await http.post("/inference/v1/generate", json=gen, headers={**bearer["alice"], "X-Session-ID": "s1"})
        assert ok.status_code == 200
        _error(await http.get("/v1/sessions/s1/trajectory", headers=bearer["bob"]), 404)  # another tenant's
        # A session key: its own session only.
        made = (await http.post("/v1/sessions", json={"sampling": {"max_tokens": 2}}, headers=bearer["alice"])).json()
        key = {"Authorization": f"Bearer {made['api_key']}"}
        sdk = openai.AsyncOpenAI(base_url=made["base_url"], api_key=made["api_key"], max_retries=0)
        await sdk.completions.create(model="toy", prompt=[1, 2, 3])
        assert (await http.get(f"/v1/sessions/{made['id']}/trajectory", headers=key)).json()["token_ids"][:3] == [
            1,
            2,
            3,
        ]
        _error(await http.get("/v1/sessions/s1/trajectory", headers=key), 404)
        _error(await http.post("/inference/v1/generate", json=gen, headers={**key, "X-Session-ID": "s1"}), 403)
        # Admin routes: admin tenants only; the weight update goes through the bridge.
        _error(await http.post("/update_weights", json={"weight_dir": "/x"}, headers=bearer["alice"]), 403)
        up = await http.post("/update_weights", json={"weight_dir": "/x"}, headers=bearer["ops"])
        assert up.json() == {"status": "ok", "policy_version": 1} and server.bridge.policy_version == 1
        for path in ("/pause", "/resume"):  # admin only
            _error(await http.post(path, json={}, headers=bearer["alice"]), 403)
        _error(await http.post("/reload_weights", headers=bearer["alice"]), 403)
        reloaded = await http.post("/reload_weights", headers=bearer["ops"])
        assert reloaded.json() == {"status": "ok", "policy_version": 2} and server.bridge.policy_version == 2
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
    await sdk.close()


async def test_errors_409_413_429(start_bridge: StartBridge) -> None:
    server, _, base = await _open(
        start_bridge,
        admission={"max_episodes": 2},
        http={"max_body_bytes": 4096},
        engine={"type": "toy", "toy": {"token_delay_s": 0.02}},
    )
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        slow = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 20, "ignore_eos": True}}
        first = asyncio.create_task(http.post("/inference/v1/generate", json=slow, headers={"X-Session-ID": "busy"}))
        for _ in range(500):  # until the first call holds the session
            if (session := _session(server, "busy")) is not None and session.busy:
                break
            await asyncio.sleep(0.01)
        err = _error(await http.post("/inference/v1/generate", json=slow, headers={"X-Session-ID": "busy"}), 409)
        assert err["type"] == "conflict_error"
        assert (await first).status_code == 200
        _error(await http.post("/v1/completions", content=json.dumps({"prompt": [1] * 5000})), 413)
        await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})  # the second open episode
        full = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert _error(full, 429)["type"] == "rate_limit_error" and full.headers["retry-after"] == "1"


async def test_a_session_is_an_episode_grpc_can_end(front: Any) -> None:
    _, client, http = front
    r = await http.post(
        "/inference/v1/generate",
        json={"token_ids": [3, 4], "sampling_params": {"max_tokens": 3}},
        headers={"X-Session-ID": "g"},
    )
    traj = (await http.get("/v1/sessions/g/trajectory")).json()
    ended = await client.end_episode(traj["episode_id"], reward=2.0)
    assert ended.token_ids.tolist() == [3, 4, *r.json()["choices"][0]["token_ids"]]
    # Ended through gRPC: the session's episode is gone for HTTP too.
    _error(await http.get("/v1/sessions/g/trajectory"), 404)


async def test_rl_client_opens_a_session_for_a_harness_and_fetches_its_trajectory(front: Any) -> None:
    from rl_client.http import BridgeHTTPError, end_session, fetch_trajectory, open_session

    _, _, http = front
    root = str(http.base_url).rstrip("/")
    s = await asyncio.to_thread(open_session, root, sampling={"max_tokens": 4, "temperature": 0})
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) as harness:
        r = await harness.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}])
    traj = await asyncio.to_thread(fetch_trajectory, s)
    assert traj["session_id"] == s.id and sum(traj["loss_mask"]) == r.usage.completion_tokens == 4  # type: ignore[union-attr]
    ended = await asyncio.to_thread(end_session, s, [0.5])
    assert ended["rewards"] == [0.5]
    with pytest.raises(BridgeHTTPError) as info:
        await asyncio.to_thread(open_session, root, group_size=0)
    assert info.value.status == 400


async def test_pause_abort_keeps_partial_tokens_and_new_calls_wait_for_resume(start_bridge: StartBridge) -> None:
    server, _, base = await _open(start_bridge, engine={"type": "toy", "toy": {"token_delay_s": 0.02}})
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        running = asyncio.create_task(http.post("/inference/v1/generate", json=gen, headers={"X-Session-ID": "a"}))
        for _ in range(500):  # until the turn is streaming
            if server.bridge.turns.live:
                break
            await asyncio.sleep(0.01)
        paused = await http.post("/pause", json={"mode": "abort"})
        assert paused.json() == {"status": "paused", "mode": "abort", "aborted": 1}
        done = (await running).json()["choices"][0]
        assert done["finish_reason"] == "abort" and 0 < len(done["token_ids"]) < 200  # partial tokens returned
        trajectory = (await http.get("/v1/sessions/a/trajectory")).json()
        assert trajectory["token_ids"] == [1, 2, 3, *done["token_ids"]]  # ... and kept in the session
        short = {**gen, "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
        waiting = asyncio.create_task(http.post("/inference/v1/generate", json=short, headers={"X-Session-ID": "b"}))
        await asyncio.sleep(0.3)
        assert not waiting.done() and server.bridge.paused  # held while paused
        assert (await http.post("/resume")).json() == {"status": "ok"}
        assert len((await waiting).json()["choices"][0]["token_ids"]) == 2


async def test_an_engine_that_cannot_do_it_answers_501_with_openai_error_json(start_bridge: StartBridge) -> None:
    _, _, base = await _open(start_bridge, engine={"type": "toy", "toy": {"supports_weight_updates": False}})
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        err = _error(await http.post("/update_weights", json={"weight_dir": "/x"}), 501)
        lora = _error(await http.post("/update_weights", json={"weight_dir": "0", "adapter": "a"}), 501)  # fuzz-found
    assert err["type"] == "not_implemented_error" and "cannot load new weights" in err["message"]
    assert lora["type"] == "not_implemented_error" and "cannot serve LoRA adapters" in lora["message"]
