"""The exact prefix index on real engines: a real vLLM publishing KV events (its KV capped at 24 blocks of 32
tokens, so turns evict each other), the session's vLLM without events beside it, a real Redis index, the real
gRPC bridge.

Ground truth is vLLM itself: a probe request for a chain (max_tokens 1, the turn's cache_salt) reports how many
of its tokens vLLM had cached, and the index must have credited exactly that many (at block granularity; vLLM
never counts a prompt's last token as cached).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from cache.event_index import EventIndexer
from cache.kv_events import Batch, EventReader, Message, Resync
from core.salt import CacheSalt
from engines import make_engines
from engines.config import EngineConfig
from engines.http.vllm import vllm_salt
from engines.launch import VllmProcess, provision_vllm
from rl_client import AsyncBridgeClient
from server.app import BridgeServer
from tests.integration.engine_script import bridge_over, index_lookup
from tests.integration.redis_proc import PrivateRedis

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
KV_BLOCKS = 24
SALT = str(CacheSalt("smollm2", 0))
T = TypeVar("T")


@pytest.fixture(scope="module")
def events_vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    provision_vllm()
    log = tmp_path_factory.mktemp("vllm-events") / "vllm.log"
    server = VllmProcess.start(
        str(model_dir),
        log,
        extra_args=("--num-gpu-blocks-override", str(KV_BLOCKS)),
        env={"PRIMERL_VLLM_MAX_MODEL_LEN": "512"},
    )
    try:
        server.wait_ready(timeout_s=600)
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bridge(
    events_vllm: VllmProcess, vllm_url: str, redis_server: PrivateRedis
) -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient]]:
    await post(f"{events_vllm.url}/reset_prefix_cache")
    engines = await make_engines(
        EngineConfig(type="vllm", urls=[events_vllm.registered_url, vllm_url], model="smollm2")
    )
    overrides = {
        "cache": {"block_size": BLOCK, "backend": "redis", "key_prefix": f"kvev{time.monotonic_ns()}"},
        "redis": {"url": redis_server.url},
        "routing": {"policy": "cache_aware"},
    }
    async with bridge_over(engines, **overrides) as pair:
        yield pair


def indexer_of(server: BridgeServer) -> EventIndexer:
    return server.bridge.router.events[0]


async def settle(ix: EventIndexer, quiet_s: float = 1.0) -> None:
    """Wait until the replica's events stop arriving (vLLM publishes a step's events after the step)."""
    last, since = -1, time.monotonic()
    async with asyncio.timeout(30):
        while True:
            await ix.index.flush()
            seen = ix.counts["batches"] + ix.counts["resyncs"] + ix.counts["restarts"]
            if seen != last or ix.behind:  # (behind: a batch read waits for a gap's replay)
                last, since = seen, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            await asyncio.sleep(0.1)


async def credited(server: BridgeServer, tokens: list[int]) -> int:
    """Tokens of ``tokens`` the index credits to replica 0, capped as vLLM caps cached tokens."""
    router = server.bridge.router
    assert router.index is not None
    match = await index_lookup(router.index, router.fingerprinter.hashes(tokens, SALT))
    return min(match.blocks.get(0, 0), (len(tokens) - 1) // BLOCK) * BLOCK


async def eventually(ask: Callable[[], Awaitable[T]], done: Callable[[T], bool], within_s: float = 20.0) -> T:
    """``ask()`` every 0.2 s until ``done`` holds of its answer, at most ``within_s``; the last answer."""
    got = await ask()
    for _ in range(int(within_s / 0.2)):
        if done(got):
            break
        await asyncio.sleep(0.2)
        got = await ask()
    return got


async def credited_soon(server: BridgeServer, tokens: list[int], want: int) -> int:
    """``credited`` once it equals ``want``, or its value after 20 s: the index follows the engine's events, which
    a loaded machine may deliver seconds after the response (the index is eventually exact)."""
    return await eventually(lambda: credited(server, tokens), lambda got: got == want)


async def post(url: str, json: object = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        response = await http.post(url, json=json)
    response.raise_for_status()
    return response


async def probe(url: str, tokens: list[int]) -> int:
    """vLLM's cached tokens for ``tokens`` under the bridge's salt (the probe itself stores the chain again)."""
    body = {"model": "smollm2", "prompt": tokens, "max_tokens": 1, "temperature": 0, "cache_salt": vllm_salt(SALT)}
    usage = (await post(f"{url}/v1/completions", body)).json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def episode(client: AsyncBridgeClient, server: BridgeServer, seed: int, turns: int = 2) -> tuple[str, int]:
    """A two-turn episode with a distinct 200-token prompt; returns its id and the replica it ran on."""
    prompt = [(seed * 997 + i * 31) % 40000 + 200 for i in range(200)]
    ep = (await client.start_episode(prompt, sampling={"max_tokens": 16, "temperature": 0})).episode_id
    await client.step(ep)
    for t in range(turns - 1):
        await client.step(ep, [(seed * 13 + t * 7 + i) % 40000 + 200 for i in range(40)])
    return ep, server.bridge.store.get(ep, "").replica


async def test_batches_missed_while_away_are_replayed_or_resynced(events_vllm: VllmProcess) -> None:
    """A subscriber that was away (the real way to lose ZMQ messages: nobody queues them for it) gets the missed
    batches from vLLM's replay socket; a subscriber without one reports a Resync. (Runs first: the next test
    restarts the server.)"""
    p = events_vllm.events_port
    endpoint, replay = f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}"
    with_replay, without = EventReader(endpoint, replay), EventReader(endpoint, "")
    streams = {id(r): r.messages() for r in (with_replay, without)}

    async def collect(reader: EventReader, until: int) -> list[Message]:
        out: list[Message] = []
        async with asyncio.timeout(60):
            while not (out and isinstance(out[-1], Batch) and out[-1].seq >= until):
                out.append(await anext(streams[id(reader)]))
        return out

    async with httpx.AsyncClient(base_url=events_vllm.url, timeout=120, trust_env=False) as http:

        async def turn(i: int) -> int:
            """One request (its steps publish batches); returns the newest batch number published."""
            # The bridge's salt: the next test's bridge replays these batches and can map them.
            body = {"model": "smollm2", "prompt": [300 + i] * 70, "max_tokens": 2, "cache_salt": vllm_salt(SALT)}
            (await http.post("/v1/completions", json=body)).raise_for_status()
            await asyncio.sleep(0.3)  # vLLM publishes a step's events after the step
            return max((await with_replay.replay(0)).keys())

        try:
            await turn(0)  # published before either reader subscribed
            for reader in (with_replay, without):
                reader.connect()
            await asyncio.sleep(0.5)
            top = await turn(1)
            got_a, got_b = await collect(with_replay, top), await collect(without, top)
            for reader in (with_replay, without):
                reader.close()  # away: the next batches are published to nobody
            for i in range(2, 5):
                await turn(i)
            for reader in (with_replay, without):
                reader.connect()
            await asyncio.sleep(0.5)
            top = await turn(9)
            got_a += await collect(with_replay, top)
            got_b += await collect(without, top)
        finally:
            with_replay.close()
            without.close()
    seqs = [m.seq for m in got_a if isinstance(m, Batch)]
    assert seqs == list(range(top + 1)) and not any(isinstance(m, Resync) for m in got_a), got_a
    resyncs = [m for m in got_b if isinstance(m, Resync)]
    assert len(resyncs) >= 2 and resyncs[0].expected == 0, got_b  # joined late, then away


async def test_a_block_vllm_caches_twice_stays_indexed_until_its_last_copy_goes(
    bridge: tuple[BridgeServer, AsyncBridgeClient], events_vllm: VllmProcess
) -> None:
    """vLLM does not de-duplicate its cache: two greedy requests over one prompt each fill their own copy of the
    block where the prompt ends and the (identical) output begins, and vLLM publishes a store for each and, later,
    a removal for each. Evicting the first copy must leave the block indexed while the second is cached.
    (Before the restart test: it leaves this module's server stopped.)"""
    server, client = bridge
    ix = indexer_of(server)
    for seed in range(41, 47):  # a turn of the bridge on replica 0: the salt of that replica's events is known
        if (await episode(client, server, seed, turns=1))[1] == 0:
            break
    else:
        raise AssertionError("no episode went to replica 0")
    prompt = [(i * 7919) % 40000 + 300 for i in range(8 * BLOCK - 6)]  # the 8th block: its last 26, 6 generated
    body = {
        "model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "cache_salt": vllm_salt(SALT), "return_token_ids": True,
    }  # fmt: skip
    url = f"{events_vllm.url}/v1/completions"
    first, second = await asyncio.gather(post(url, body), post(url, body))
    out = first.json()["choices"][0]["token_ids"]
    assert out == second.json()["choices"][0]["token_ids"]  # greedy: the same block twice
    history = prompt + out[:7]  # 8 full blocks, and the token vLLM never counts as cached
    await settle(ix)
    twice = [h for h, n in ix.copies.items() if n == 2]
    assert twice, dict(ix.counts)
    assert await credited(server, history) == 8 * BLOCK
    # Requests of one full block and one token (33 prompt tokens) each need two blocks: the uncached one the last
    # filler freed (vLLM reuses those first) and the least recently freed cached block, evicted. So the cached
    # blocks go one at a time, oldest first: the first copy before the second.
    for i in range(3 * KV_BLOCKS):
        filler = {
            "model": "smollm2",
            "prompt": [(i * 131 + j) % 40000 + 400 for j in range(BLOCK + 1)],
            "max_tokens": 1,
        }
        await post(url, filler)
        await settle(ix, quiet_s=0.3)
        if any(ix.copies.get(h, 0) < 2 for h in twice):
            break
    once = [h for h in twice if ix.copies.get(h, 0) == 1]
    assert once, ("both copies went at once", dict(ix.counts))
    assert await credited(server, history) == 8 * BLOCK  # the index still credits the block vLLM still holds
    assert await probe(events_vllm.url, history) == 8 * BLOCK


async def test_the_index_follows_evictions_a_reset_and_a_restart(
    bridge: tuple[BridgeServer, AsyncBridgeClient], events_vllm: VllmProcess, model_dir: Path
) -> None:
    server, client = bridge
    router = server.bridge.router
    ix = indexer_of(server)
    assert [router.index_source(r) for r in (0, 1)] == ["kv_events", "learned"]
    info = await client.server_info()
    assert list(info.models[0].index_sources) == ["kv_events", "learned"]

    # 1. Eight episodes over both replicas; replica 0's 24 blocks cannot hold its share: vLLM evicts.
    placed = [await episode(client, server, seed) for seed in range(8)]
    await settle(ix)
    on0 = [ep for ep, r in placed if r == 0]
    on1 = [ep for ep, r in placed if r == 1]
    assert on0 and on1, placed
    assert ix.counts["stored"] > KV_BLOCKS and ix.counts["removed"] > 0, dict(ix.counts)
    assert ix.counts["unmapped"] == 0 and ix.counts["resyncs"] == 0, dict(ix.counts)
    histories = {ep: list(server.bridge.store.get(ep, "").token_ids) for ep, _ in placed}
    # The index credits replica 0 with exactly what vLLM holds, chain by chain (the oldest were evicted).
    expected = {ep: await credited(server, histories[ep]) for ep in on0}
    assert 0 in expected.values() or min(expected.values()) < max(expected.values()), expected
    for ep in on0:
        await settle(ix)  # each probe stores its chain again, evicting others: the index follows
        want = await credited(server, histories[ep])
        assert await probe(events_vllm.url, histories[ep]) == want, (ep, want, expected)
        full = (len(histories[ep]) - 1) // BLOCK * BLOCK
        assert await credited_soon(server, histories[ep], full) == full, dict(ix.counts)
    # Replica 1 publishes nothing and keeps working on the learned index: its episodes' chains are credited.
    for ep in on1:
        hashes = router.fingerprinter.hashes(histories[ep], SALT)
        assert router.index is not None
        match = await index_lookup(router.index, hashes)
        assert match.blocks.get(1, 0) == len(hashes), match

    # 2. A cache reset: vLLM sends AllBlocksCleared at its next step; replica 0's entries go.
    await post(f"{events_vllm.url}/reset_prefix_cache")
    ep0 = on0[0]
    await client.step(ep0, list(range(500, 540)))
    await settle(ix)
    assert ix.counts["cleared"] >= 1
    histories[ep0] = list(server.bridge.store.get(ep0, "").token_ids)
    full = (len(histories[ep0]) - 1) // BLOCK * BLOCK
    assert await credited_soon(server, histories[ep0], full) == full, dict(ix.counts)
    for ep in on0[1:]:
        assert await credited(server, histories[ep]) == 0

    # 3. A restart on the same ports: its publisher numbers from 0 again; the replica's entries are dropped,
    # then relearned from its new events.
    port = int(events_vllm.url.rsplit(":", 1)[1])
    events_vllm.stop()
    restarted = VllmProcess.start(
        str(model_dir),
        events_vllm.log_path.with_name("vllm-restarted.log"),
        port=port,
        extra_args=("--num-gpu-blocks-override", str(KV_BLOCKS)),
        env={"PRIMERL_VLLM_MAX_MODEL_LEN": "512"},
        events_port=events_vllm.events_port,
    )
    try:
        await asyncio.to_thread(restarted.wait_ready, 600)
        for _ in range(300):  # the bridge's health checks bring the replica back into rotation
            if router.replicas.healthy[0]:
                break
            await asyncio.sleep(0.2)
        for seed in range(100, 106):  # new episodes until one lands on the restarted replica
            ep, replica = await episode(client, server, seed, turns=1)
            if replica == 0:
                break
        assert replica == 0
        await settle(ix)
        assert ix.counts["restarts"] == 1, dict(ix.counts)
        history = list(server.bridge.store.get(ep, "").token_ids)
        held = await credited(server, history)
        assert held == await probe(restarted.url, history)
        assert held > 0
    finally:
        restarted.stop()
