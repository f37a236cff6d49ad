"""``EndEpisode(discard=true)``: the episode is freed without building a trajectory.

Through a real gRPC bridge: the response is empty, the episode is gone (a second EndEpisode, or a Step,
gets NOT_FOUND) and the open-episodes gauge the HPA scales on drops.
"""

from __future__ import annotations

import grpc
import pytest

from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from rl_client import AsyncBridgeClient
from rl_client.errors import NotFoundError
from server.app import BridgeServer

Bridge = tuple[BridgeServer, AsyncBridgeClient]
PROMPT = [1, 4, 30, 31, 32, 2, 5]


def open_episodes(server: BridgeServer) -> float:
    value = server.metrics.registry.get_sample_value("primerl_active_episodes", {"model": "toy"})
    assert value is not None
    return value


async def test_discard_returns_nothing_frees_the_episode_and_the_gauge_drops(bridge: Bridge) -> None:
    server, client = bridge
    keep = (await client.start_episode(PROMPT, sampling={"max_tokens": 4})).episode_id
    ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 4})).episode_id
    await client.step(ep)
    assert open_episodes(server) == 2

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.PrimeRLStub(channel)
        resp = await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0], discard=True), timeout=10)
        assert resp == pb.EndEpisodeResponse()  # no trajectory was built
        assert not resp.HasField("trajectory")
        assert open_episodes(server) == 1

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, discard=True), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError):
        await client.end_episode(ep)
    with pytest.raises(NotFoundError):
        await client.step(ep)

    await client.discard_episode(keep)  # the client's helper does the same
    assert open_episodes(server) == 0
    assert not server.bridge.store._episodes
