"""One episode script run unchanged on every engine (embedded, vllm, and the SGLang/TRT-LLM stand-ins).

Also the helpers that put a bridge in front of already-built engine adapters, and read its prefix index.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from cache.index import Match, PrefixIndex
from engines.base import Engine
from rl_client import AsyncBridgeClient
from rl_client.errors import FailedPreconditionError
from server.app import BridgeServer, create_server
from server.config import load_settings

PROMPT = [{"role": "user", "content": "What is two plus two?"}]
OBSERVATIONS = [
    [{"role": "tool", "content": "result: four"}],
    [{"role": "user", "content": "And two plus three?"}],
]


@asynccontextmanager
async def bridge_over(
    engines: Sequence[Engine], **overrides: Any
) -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient]]:
    """A real gRPC bridge on a free port in front of ``engines`` (closed, engines included, on exit)."""
    overrides.setdefault("server", {}).setdefault("port", 0)
    overrides["server"].setdefault("grace_period_s", 1.0)
    overrides.setdefault("metrics", {}).setdefault("port", 0)
    server = await create_server(load_settings(**overrides), engines=list(engines))
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=120)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(0.5)


async def run_episode_script(client: AsyncBridgeClient, max_tokens: int = 8, seed: int = 11) -> dict[str, Any]:
    """Three turns from chat messages (prompt, tool result, user follow-up); checks the trajectory.

    Returns the turns and trajectory so callers can add engine-specific checks.
    """
    started = await client.start_episode(PROMPT, sampling={"temperature": 1.0, "max_tokens": max_tokens, "seed": seed})
    ep = started.episode_id
    turns = [await client.step(ep)]
    streamed = []
    for i, obs in enumerate(OBSERVATIONS):
        if i == 0:
            turns.append(await client.step(ep, obs))
        else:  # the last turn streamed: chunks must add up to the turn
            chunks = [c async for c in client.stream_step(ep, obs)]
            streamed = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].done is not None
            turns.append(chunks[-1].done)
    traj = await client.end_episode(ep, reward=1.0)

    assert len(traj.turns) == 3
    assert streamed == turns[-1].token_ids.tolist()
    sampled = np.zeros(len(traj.token_ids), dtype=bool)
    for info, turn in zip(traj.turns, turns, strict=True):
        assert 1 <= info.end - info.generation_start <= max_tokens
        assert traj.token_ids[info.generation_start : info.end].tolist() == turn.token_ids.tolist()
        np.testing.assert_array_equal(traj.logprobs[info.generation_start : info.end], turn.logprobs)
        assert info.finish_reason in ("stop", "length")
        assert turn.usage.generated_tokens == len(turn.token_ids)
        assert turn.usage.prompt_tokens == info.generation_start
        sampled[info.generation_start : info.end] = True
    assert traj.loss_mask.tolist() == sampled.tolist()
    assert all(math.isfinite(x) and x <= 0 for x in traj.logprobs[sampled])
    assert np.isnan(traj.logprobs[~sampled]).all()
    assert traj.prompt_length == started.prompt_tokens
    # Observations were appended after each turn's tokens (append-only: earlier ids unchanged).
    assert traj.turns[1].observation_start == traj.turns[0].end
    assert traj.turns[2].observation_start == traj.turns[1].end
    return {"started": started, "turns": turns, "trajectory": traj}


async def end_when_idle(client: AsyncBridgeClient, episode_id: str):  # type: ignore[no-untyped-def]
    """EndEpisode once the server has processed a failed or cancelled Step (bounded wait)."""
    for _ in range(500):
        try:
            return await client.end_episode(episode_id)
        except FailedPreconditionError:
            await asyncio.sleep(0.01)
    raise AssertionError("episode stayed busy after its Step ended")


async def index_lookup(index: PrefixIndex, hashes: Sequence[int], within_s: float = 20.0) -> Match:
    """The bridge's index lookup, asked again every 0.2 s while it fails open: a lookup over its budget (2 ms by
    default) on a machine busy with other tests answers "nothing" (``ok`` False), which reads as "not cached"."""
    for _ in range(int(within_s / 0.2)):
        match = await index.lookup(hashes)
        if match.ok:
            return match
        await asyncio.sleep(0.2)
    raise AssertionError(f"every index lookup failed open for {within_s:g} s")
