"""The live inspector's JSON routes and event stream against a real bridge (toy engine) on free ports.

What an RL engineer (or a script) would notice: the episode list shows open and ended episodes of every surface
(gRPC and HTTP) with working filters; one episode's arrays equal the trajectory ``EndEpisode`` returned, token by
token; the event stream carries each Step as it happens and ends when the bridge stops; each tenant sees only its
own episodes; bad input is a 400 naming the field; the memory of ended episodes is bounded by count and bytes.
The page itself, in Chromium on the embedded model: test_inspector_web.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from core.types import Origin
from engines.launch import free_port
from rl_client import AsyncBridgeClient
from server.app import BridgeServer
from server.auth import hash_token
from server.cli import inspector_url, main
from tests.conftest import StartBridge

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "ops": "tok-ops"}
SSE = {"Accept": "text/event-stream"}


async def _open(start_bridge: StartBridge, **overrides: Any) -> tuple[BridgeServer, AsyncBridgeClient, str]:
    server, client = await start_bridge(http={"port": free_port()}, **overrides)
    return server, client, f"http://127.0.0.1:{server.http_port}"


async def _read_events(http: httpx.AsyncClient, out: list[tuple[str, str, dict[str, Any]]], **kw: Any) -> str:
    """Collect (id, event, data) from the SSE stream until the server ends it; returns the raw ``retry:`` line."""
    retry = ""
    async with http.stream("GET", "/v1/inspect/events", headers={**SSE, **kw.pop("headers", {})}, **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        async for line in r.aiter_lines():
            if line.startswith("retry:"):
                retry = line
            elif line == "":
                if "event" in block:
                    out.append((block.get("id", ""), block["event"], json.loads(block["data"])))
                block = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                block[key] = value
    return retry


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def front(start_bridge: StartBridge) -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient, httpx.AsyncClient]]:
    server, client, base = await _open(start_bridge)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        yield server, client, http


async def test_episodes_match_end_episode_token_by_token_and_stream_live(front: Any) -> None:
    server, client, http = front
    events: list[tuple[str, str, dict[str, Any]]] = []
    reader = asyncio.create_task(_read_events(http, events))
    await _until(lambda: any(e[1] == "hello" for e in events))
    started = await client.start_episode([5, 6, 7], group_size=2, sampling={"max_tokens": 6, "seed": 3})
    first, second = started.episode_ids
    await client.step(first)
    await client.step(first, [8, 9])
    await client.step(second)
    listed = (await http.get("/v1/inspect/episodes")).json()
    assert listed["auth"] is False and listed["every_tenant"] is True
    rows = {r["id"]: r for r in listed["episodes"]}
    assert rows[first]["status"] == "idle" and rows[first]["turns"] == 2 and rows[first]["group_id"] == started.group_id
    traj = await client.end_episode(first, 1.5)
    # The ended episode: the same arrays as EndEpisode's trajectory, each token with its text.
    detail = (await http.get(f"/v1/inspect/episodes/{first}")).json()
    assert detail["summary"]["status"] == "ended" and detail["rewards"] == [1.5]
    assert detail["token_ids"] == traj.token_ids.tolist() and len(detail["token_text"]) == len(traj)
    assert detail["origins"] == [Origin(o).name.lower() for o in traj.origins.tolist()]
    assert detail["loss_mask"] == [int(m) for m in traj.loss_mask.tolist()]
    for got, want in zip(detail["logprobs"], traj.logprobs.tolist(), strict=True):
        assert (got is None and math.isnan(want)) or got == pytest.approx(want, abs=1e-6)
    assert [t["replica"] for t in detail["turns"]] == [0, 0] and detail["turns"][1]["usage"]["generated_tokens"] > 0
    assert [m["id"] for m in detail["group"]] == [first, second]  # the group's members, open or ended
    assert {m["status"] for m in detail["group"]} == {"ended", "idle"}
    # Filters combine; the stream saw every Step as it happened, then the end.
    ended = (await http.get("/v1/inspect/episodes", params={"status": "ended"})).json()["episodes"]
    assert [r["id"] for r in ended] == [first]
    group = (await http.get("/v1/inspect/episodes", params={"group": started.group_id, "status": "open"})).json()
    assert [r["id"] for r in group["episodes"]] == [second]
    await _until(lambda: any(e[1] == "episode_ended" for e in events))
    kinds = [(k, d["id"]) for _, k, d in events if "id" in d]
    assert kinds[:2] == [("episode_started", first), ("episode_started", second)]
    assert kinds[2:] == [("step_started", first), ("step_ended", first)] * 2 + [
        ("step_started", second), ("step_ended", second), ("episode_ended", first)
    ]  # fmt: skip
    assert all(i.split("-")[1].isdigit() for i, k, _ in events if k != "hello")
    # A page that reconnects with Last-Event-ID gets what it missed; the JSON form serves scripts.
    last = events[3][0]
    missed = (await http.get("/v1/inspect/events", headers={"Last-Event-ID": last})).json()
    assert [e["id"] for e in missed["events"]] == [e[0] for e in events[4:]] and missed["reset"] is False
    assert (await http.get("/v1/inspect/events", params={"last_event_id": "other-1"})).json()["reset"] is True
    # Stopping the bridge ends the stream at once (it does not hold the front door's shutdown).
    loop = asyncio.get_running_loop()
    began = loop.time()
    await server.stop(0.2)
    retry = await asyncio.wait_for(reader, 10)
    assert retry == "retry: 1000" and loop.time() - began < 5


async def test_http_sessions_show_request_ids_and_branches(front: Any) -> None:
    _, _, http = front
    sid, h = "chat-1", {"X-Session-ID": "chat-1"}
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "toy", "messages": messages, "max_tokens": 4, "seed": 1}
    r1 = await http.post("/v1/chat/completions", json=body, headers={**h, "x-request-id": "rid-one"})
    reply = r1.json()["choices"][0]["message"]
    turn2 = [*messages, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "more"}]
    await http.post("/v1/chat/completions", json={**body, "messages": turn2}, headers={**h, "x-request-id": "rid-two"})
    fork = [{"role": "user", "content": "something else"}]
    await http.post("/v1/chat/completions", json={**body, "messages": fork}, headers={**h, "x-request-id": "rid-3"})
    rows = (await http.get("/v1/inspect/episodes", params={"session_id": sid})).json()["episodes"]
    assert sorted(r["branch"] for r in rows) == [0, 1]
    by_rid = (await http.get("/v1/inspect/episodes", params={"request_id": "rid-two"})).json()["episodes"]
    assert len(by_rid) == 1 and by_rid[0]["branch"] == 0 and by_rid[0]["request_ids"] == ["rid-one", "rid-two"]
    newest = next(r for r in rows if r["branch"] == 1)
    detail = (await http.get(f"/v1/inspect/episodes/{newest['id']}")).json()
    assert detail["session"]["id"] == sid and detail["session"]["branch"] == 1
    assert [b["branch"] for b in detail["session"]["branches"]] == [0, 1]
    assert detail["session"]["fork_common_tokens"] is not None
    assert "".join(detail["token_text"]).count("something") == 1


async def test_tenants_see_only_their_own_and_bad_input_names_the_field(start_bridge: StartBridge) -> None:
    entries = [f"{t}:{hash_token(v)}" for t, v in TOKENS.items()]
    server, _, base = await _open(start_bridge, auth={"token_hashes": entries, "admin_tenants": ["ops"]})
    clients = {t: AsyncBridgeClient(f"127.0.0.1:{server.port}", token=v) for t, v in TOKENS.items()}
    bearer = {t: {"Authorization": f"Bearer {v}"} for t, v in TOKENS.items()}
    try:
        mine = {t: (await clients[t].start_episode([1, 2, 3], sampling={"max_tokens": 3})).episode_ids[0]
                for t in ("alice", "bob")}  # fmt: skip
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:

            async def ids(who: str, **params: str) -> list[str]:
                r = await http.get("/v1/inspect/episodes", params=params, headers=bearer[who])
                assert r.status_code == 200, r.text
                return [e["id"] for e in r.json()["episodes"]]

            assert await ids("alice") == [mine["alice"]] and await ids("bob") == [mine["bob"]]
            assert sorted(await ids("ops")) == sorted(mine.values())  # an admin tenant sees every tenant's
            assert await ids("ops", tenant="bob") == [mine["bob"]]
            err = (await http.get(f"/v1/inspect/episodes/{mine['alice']}", headers=bearer["bob"])).json()["error"]
            assert err["code"] == 404 and "another tenant" in err["message"]
            r = await http.get("/v1/inspect/episodes", params={"tenant": "alice"}, headers=bearer["bob"])
            assert r.status_code == 403
            await clients["alice"].step(mine["alice"])
            seen = (await http.get("/v1/inspect/events", headers=bearer["bob"])).json()["events"]
            assert {e["data"]["id"] for e in seen} == {mine["bob"]}  # bob's stream never carries alice's Steps
            # Wrong token, bad filters, unknown ids, session keys, the admin-only fleet view.
            r = await http.get("/v1/inspect/episodes", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert (await http.get("/v1/inspect/episodes")).status_code == 401
            for params, field in (({"status": "weird"}, "status"), ({"limit": "0"}, "limit"),
                                  ({"limit": "x"}, "limit"), ({"colour": "red"}, "colour")):  # fmt: skip
                r = await http.get("/v1/inspect/episodes", params=params, headers=bearer["alice"])
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert (await http.get("/v1/inspect/episodes/ep-nope", headers=bearer["ops"])).status_code == 404
            key = (await http.post("/v1/sessions", json={}, headers=bearer["alice"])).json()["api_key"]
            r = await http.get("/v1/inspect/episodes", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 403
            assert (await http.get("/v1/inspect/fleet", headers=bearer["alice"])).status_code == 403
            fleet = (await http.get("/v1/inspect/fleet", headers=bearer["ops"])).json()
            assert [r["state"] for r in fleet["replicas"]] == ["active"] and fleet["replicas"][0]["healthy"] is True
            assert fleet["replicas"][0]["cache"]["turns"] == 1 and fleet["open_episodes"] == 2
    finally:
        for c in clients.values():
            await c.close()


async def test_weight_updates_and_pauses_show_in_the_fleet_view(start_bridge: StartBridge) -> None:
    _, _, base = await _open(start_bridge, engine={"type": "toy", "toy": {"supports_weight_updates": True}})
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        assert (await http.get("/v1/inspect/fleet")).json()["last_weight_update"] is None
        await http.post("/pause", json={"mode": "keep"})
        await asyncio.sleep(0.05)
        await http.post("/update_weights", json={"weight_dir": "/ckpt"})
        await http.post("/resume")
        fleet = (await http.get("/v1/inspect/fleet")).json()
        last = fleet["last_weight_update"]
        assert fleet["policy_version"] == 1 and last["previous_version"] == 0 and last["version"] == 1
        assert last["in_pause"] is True and last["paused_ms"] >= 50 and fleet["paused"] is False
        assert fleet["replicas"][0]["policy_version"] == 1 and fleet["bridges"][0]["models"] == ["toy"]
        kinds = [e["type"] for e in (await http.get("/v1/inspect/events")).json()["events"]]
        assert kinds == ["paused", "weights_updated", "resumed"]


async def test_ended_episodes_are_bounded_by_count_and_by_bytes(start_bridge: StartBridge) -> None:
    for bound, ending in (({"max_ended_episodes": 5}, 8), ({"max_ended_bytes": 6000}, 12)):
        _, client, base = await _open(start_bridge, inspector=bound)
        ids = []
        for _ in range(ending):
            ep = (await client.start_episode(list(range(1, 40)), sampling={"max_tokens": 8})).episode_ids[0]
            await client.step(ep)
            await client.end_episode(ep)
            ids.append(ep)
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            r = (await http.get("/v1/inspect/episodes")).json()
            kept = [e["id"] for e in r["episodes"]]
            assert kept == ids[::-1][: len(kept)] and r["kept"]["evicted"] == ending - len(kept)  # oldest go first
            assert (await http.get(f"/v1/inspect/episodes/{ids[0]}")).status_code == 404
            assert (await http.get(f"/v1/inspect/episodes/{ids[-1]}")).status_code == 200
        if "max_ended_episodes" in bound:
            assert len(kept) == 5
        else:
            assert 1 <= len(kept) < ending and r["kept"]["bytes"] <= 6000


async def test_the_page_and_the_schema_are_served(front: Any) -> None:
    _, _, http = front
    page = await http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"] and 'src="/ui/app.js"' in page.text
    js = await http.get("/ui/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert (await http.get("/ui/style.css")).status_code == 200
    assert (await http.get("/ui/../server/app.py")).status_code == 404
    assert (await http.get("/ui/secrets.txt")).json()["error"]["code"] == 404
    paths = (await http.get("/openapi.json")).json()["paths"]
    params = {p["name"] for p in paths["/v1/inspect/episodes"]["get"]["parameters"]}
    assert params == {"tenant", "model", "status", "session_id", "request_id", "group", "limit"}
    assert paths["/v1/inspect/episodes/{episode_id}"]["get"]["parameters"][0]["name"] == "episode_id"


async def test_the_inspector_can_be_switched_off(start_bridge: StartBridge) -> None:
    server, client, base = await _open(start_bridge, inspector={"enabled": False})
    ep = (await client.start_episode([1, 2], sampling={"max_tokens": 2})).episode_ids[0]
    await client.end_episode(ep)
    assert server.bridge.inspector.ended_count == 0
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        r = await http.get("/v1/inspect/episodes")
        assert r.status_code == 404 and "inspector.enabled" in r.json()["error"]["message"]


async def test_primerl_inspect_prints_the_page_of_a_running_bridge(
    front: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, http = front
    base = str(http.base_url).rstrip("/")
    assert inspector_url("127.0.0.1:8000/ui/") == inspector_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/ui"
    assert await asyncio.to_thread(main, ["inspect", base, "--no-open"]) == 0  # a thread: the bridge runs on this loop
    assert capsys.readouterr().out.strip() == f"{base}/ui"
    assert await asyncio.to_thread(main, ["inspect", f"127.0.0.1:{free_port()}", "--no-open"]) == 1
    assert "no bridge answers" in capsys.readouterr().err
