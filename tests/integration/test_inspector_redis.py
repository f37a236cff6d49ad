"""The inspector's ended episodes in Redis (persistence on), against real bridges (toy engine) and a private Redis.

What an RL engineer would notice: after a bridge restart the page still lists the recently ended episodes and shows
each one token by token, the same arrays ``EndEpisode`` returned; Redis expires them (a TTL on every key); a
tenant still sees only its own; with Redis gone, ending episodes goes on and the routes answer from memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from engines.launch import free_port
from rl_client import AsyncBridgeClient
from server.app import create_server
from server.auth import hash_token
from server.config import load_settings
from tests.conftest import StartBridge
from tests.integration.redis_proc import PrivateRedis

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "ops": "tok-ops"}
BEARER = {t: {"Authorization": f"Bearer {v}"} for t, v in TOKENS.items()}
SAMPLING = {"max_tokens": 5, "seed": 2}


def _settings(redis: PrivateRedis, **extra: Any) -> dict[str, Any]:
    auth = {"token_hashes": [f"{t}:{hash_token(v)}" for t, v in TOKENS.items()], "admin_tenants": ["ops"]}
    persistence = {"enabled": True, "timeout_s": 0.5}
    return {
        "redis": {"url": redis.url},
        "persistence": persistence,
        "auth": auth,
        "http": {"port": free_port()},
        **extra,
    }


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _end_some(port: int) -> dict[str, Any]:
    """alice ends two episodes (one of two turns), bob one; their trajectories by id."""
    out: dict[str, Any] = {}
    for tenant, turns in (("alice", 2), ("alice", 1), ("bob", 1)):
        async with AsyncBridgeClient(f"127.0.0.1:{port}", token=TOKENS[tenant], timeout=30) as client:
            ep = (await client.start_episode([3, 4, 5], sampling=SAMPLING)).episode_ids[0]
            for i in range(turns):
                await client.step(ep, [7] if i else None)
            out[ep] = (tenant, await client.end_episode(ep, 0.5))
    return out


async def test_a_restarted_bridge_still_shows_recently_ended_episodes(
    start_bridge: StartBridge, redis_server: PrivateRedis
) -> None:
    settings = _settings(redis_server, inspector={"ended_ttl_s": 3600})
    first = await create_server(
        load_settings(engine={"type": "toy"}, server={"port": 0}, metrics={"port": 0}, **settings)
    )
    await first.start()
    try:
        ended = await _end_some(first.port)
    finally:
        await first.stop(0.5)  # the writer's queue is flushed before the journal's Redis client closes
    server, _ = await start_bridge(**_settings(redis_server, inspector={"ended_ttl_s": 3600}))
    assert server.bridge.inspector.ended_count == 0  # nothing in this bridge's memory: all from Redis
    alice = [ep for ep, (tenant, _) in ended.items() if tenant == "alice"]
    (bob,) = [ep for ep, (tenant, _) in ended.items() if tenant == "bob"]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as http:

        async def listed(who: str, **params: str) -> list[str]:
            r = await http.get("/v1/inspect/episodes", params=params, headers=BEARER[who])
            assert r.status_code == 200 and r.json()["persisted"] == "on", r.text
            return [e["id"] for e in r.json()["episodes"]]

        assert await listed("alice") == alice[::-1]  # newest first
        assert await listed("bob") == [bob]  # a tenant sees only its own, from Redis too
        assert await listed("ops") == [bob, *alice[::-1]]  # an admin tenant sees every tenant's
        assert await listed("ops", tenant="alice", limit="1") == [alice[1]]
        for ep, (tenant, traj) in ended.items():
            r = await http.get(f"/v1/inspect/episodes/{ep}", headers=BEARER[tenant])
            assert r.status_code == 200, r.text
            detail = r.json()
            assert detail["token_ids"] == traj.token_ids.tolist() and detail["tenant"] == tenant
            for got, want in zip(detail["logprobs"], traj.logprobs.tolist(), strict=True):
                assert (got is None and math.isnan(want)) or got == pytest.approx(want, abs=1e-6)
            assert detail["loss_mask"] == [int(m) for m in traj.loss_mask.tolist()] and detail["rewards"] == [0.5]
            assert detail["summary"]["status"] == "ended" and len(detail["turns"]) == len(traj.turns)
        r = await http.get(f"/v1/inspect/episodes/{alice[0]}", headers=BEARER["bob"])
        assert r.status_code == 404 and "another tenant" in r.json()["error"]["message"]
    async with aioredis.from_url(redis_server.url) as redis:
        keys = [k.decode() for k in await redis.keys("primerl:inspect:*")]
        assert sorted(keys) == sorted(
            [f"primerl:inspect:ep:{ep}" for ep in ended]
            + ["primerl:inspect:all", "primerl:inspect:tenant:alice", "primerl:inspect:tenant:bob"]
        )
        for key in keys:
            assert 3500 < await redis.ttl(key) <= 3600, key


async def test_with_redis_down_episodes_end_and_the_routes_answer_from_memory(
    start_bridge: StartBridge, redis_server: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = await start_bridge(**_settings(redis_server))
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="server.inspector.store"):
        ended = await _end_some(server.port)  # the hooks never wait on Redis, never fail a call
        store = server.bridge.inspector.store
        assert store is not None
        await _until(lambda: store.dropped == 3)
    assert sum("not kept in Redis" in r.getMessage() for r in caplog.records) == 1  # once per outage
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as http:
        r = await http.get("/v1/inspect/episodes", headers=BEARER["ops"])
        assert r.status_code == 200 and r.json()["persisted"] == "unavailable"
        assert sorted(e["id"] for e in r.json()["episodes"]) == sorted(ended)
        assert r.json()["kept"]["persist_dropped"] == 3
        for ep, (tenant, traj) in ended.items():
            r = await http.get(f"/v1/inspect/episodes/{ep}", headers=BEARER[tenant])
            assert r.status_code == 200 and r.json()["token_ids"] == traj.token_ids.tolist()
        r = await http.get("/v1/inspect/episodes/ep-gone", headers=BEARER["ops"])
        assert r.status_code == 404 and "Redis does not answer" in r.json()["error"]["message"]
