"""Engine replicas added, drained and removed at run time through the control plane (issue 21, acceptance 4).

A real control plane (``server.fleet.service``, gRPC on a free port) and two fleet bridge processes on one private
Redis start over one stand-in engine process (r0). ``primerl replicas add`` (the CLI, as an operator runs it)
registers r1: both bridges pick it up within a few heartbeats and new episodes land on it. Draining r0 lets its
streaming turn finish (finish reason length) while new episodes go to r1 only. Removing r1 in the middle of a
streamed turn ends that turn ABORT with its partial tokens kept, and the episode continues on r0 with its exact
history.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from proto.primerl.v1 import control_pb2 as cpb
from proto.primerl.v1 import control_pb2_grpc as cpb_grpc
from proto.primerl.v1 import primerl_pb2 as pb
from rl_client import AsyncBridgeClient
from server.fleet.service import ControlServer, create_control_server
from tests.integration.fleet_bridge import ROOT, FleetBridgeProcess, bridge_pair, fleet_env, standins
from tests.integration.redis_proc import PrivateRedis
from tests.standins.serve import StandinProcess

SHORT = {"max_tokens": 4, "ignore_eos": True, "seed": 5}
LONG = {"max_tokens": 300, "ignore_eos": True, "seed": 5}  # ~3 s at 10 ms a token


def _prompt(i: int) -> list[int]:
    return [1, 4 + i % 50, 30 + i % 7, 31, 32 + i % 11, 2, 5] * 2


@pytest.fixture
def engines() -> Iterator[list[StandinProcess]]:
    with standins(2, "--token-delay-s", "0.01") as procs:
        yield procs


@pytest.fixture
async def control(redis_server: PrivateRedis) -> AsyncIterator[tuple[ControlServer, cpb_grpc.ControlAsyncStub]]:
    server = create_control_server(redis_server.url)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub: cpb_grpc.ControlAsyncStub = cpb_grpc.ControlStub(channel)
        yield server, stub
    finally:
        await channel.close(None)
        await server.stop(0)


@pytest.fixture
async def bridges(
    redis_server: PrivateRedis, engines: list[StandinProcess]
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    async with bridge_pair([engines[0].url], fleet_env(redis_server.url)) as pair:
        yield pair


async def _landed(clients: list[AsyncBridgeClient], n: int, offset: int) -> set[str]:
    """The replicas ``n`` new episodes (distinct prompts, started alternately through each bridge) landed on."""
    out = set()
    for i in range(n):
        started = await clients[i % len(clients)].start_episode(_prompt(offset + i), sampling=SHORT)
        out.add(started.replica)
        await clients[i % len(clients)].discard_episode(started.episode_id)
    return out


def _replica(model: str, url: str) -> cpb.ReplicaRequest:
    return cpb.ReplicaRequest(model=model, replica=cpb.FleetReplica(url=url))


async def test_replicas_added_drained_and_removed_at_run_time(
    control: tuple[ControlServer, cpb_grpc.ControlAsyncStub],
    bridges: tuple[FleetBridgeProcess, ...],
    engines: list[StandinProcess],
    tmp_path: Path,
) -> None:
    server, stub = control
    a, b = bridges
    r0, r1 = engines[0].url, engines[1].url
    record = await stub.GetModel(cpb.GetModelRequest(model="toy"))
    assert [r.url for r in record.replicas] == [r0] and len(record.bridges) == 2  # the bridges registered r0
    assert await _landed([a.client, b.client], 2, 0) == {"r0"}

    cmd = [sys.executable, "-m", "server", "replicas", "add", "--control", f"127.0.0.1:{server.port}"]
    cli = await asyncio.create_subprocess_exec(  # the event loop keeps serving the control plane meanwhile
        *cmd, "--model", "toy", "--engine", "sglang", r1, cwd=ROOT, stdout=PIPE, stderr=PIPE
    )
    out, err = await cli.communicate()
    assert cli.returncode == 0, err.decode()
    assert r1 in out.decode()
    await asyncio.sleep(1.0)  # a few heartbeats (fleet_env: 0.3 s)
    landed = await _landed([a.client, b.client], 8, 10)
    assert len(landed) == 2 and "r0" in landed, landed  # both bridges: r0 and the new replica get new episodes
    new_name = (landed - {"r0"}).pop()

    # Drain r0 while a turn streams on it: the turn finishes, new episodes go to r1 only.
    ep = (await a.client.start_episode(_prompt(99), sampling=SHORT)).episode_id
    home = await a.client.start_episode(_prompt(98), sampling=SHORT)
    tokens, drained = [], False
    async for chunk in a.client.stream_step(ep if home.replica == "r0" else home.episode_id, sampling=LONG):
        tokens.extend(chunk.token_ids)
        if not drained and tokens:
            await stub.DrainReplica(_replica("toy", r0))
            drained = True
        last = chunk
    assert last.done is not None and last.done.finish_reason == "length" and len(tokens) == 300
    await asyncio.sleep(1.0)
    assert await _landed([a.client, b.client], 6, 30) == {new_name}

    # Put r0 back, then remove r1 in the middle of a turn: partial tokens kept, the episode goes on on r0.
    started = await a.client.start_episode(_prompt(50), sampling=SHORT)  # r0 is draining: on r1
    assert started.replica == new_name
    on_r1 = started.episode_id
    await stub.AddReplica(_replica("toy", r0))
    await asyncio.sleep(1.0)
    partial: list[int] = []
    removed = False
    async for chunk in a.client.stream_step(on_r1, sampling=LONG):
        partial.extend(chunk.token_ids)
        if not removed and partial:
            await stub.RemoveReplica(_replica("toy", r1))
            removed = True
        last = chunk
    assert last.done is not None and last.done.finish_reason == "abort" and 0 < len(partial) < 300
    after = await a.client.step(on_r1, [9, 10], sampling=SHORT)
    traj = await a.client.end_episode(on_r1)
    assert traj.token_ids.tolist() == [*_prompt(50), *partial, 9, 10, *after.token_ids]
    record = await stub.GetModel(cpb.GetModelRequest(model="toy"))
    assert [(r.url, r.state) for r in record.replicas] == [(r0, "active")]

    # A fleet-wide weight update through the control plane: run by a live bridge, the whole fleet moves.
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    updated = await stub.UpdateWeights(pb.UpdateWeightsRequest(model="toy", checkpoint_path=str(checkpoint)))
    assert updated.policy_version == 1 and updated.replicas_updated == 1  # r1 was removed: r0 alone took it
    assert (await stub.GetModel(cpb.GetModelRequest(model="toy"))).policy_version == 1
    started = await b.client.start_episode(_prompt(7), sampling=SHORT)
    assert started.policy_version == 1 and (await b.client.step(started.episode_id)).policy_version == 1


async def test_the_control_plane_refuses_bad_input_with_clear_statuses(
    control: tuple[ControlServer, cpb_grpc.ControlAsyncStub],
) -> None:
    _, stub = control
    cases: list[tuple[Any, grpc.StatusCode, str]] = [
        (stub.AddReplica(_replica("toy", "ftp://x")), grpc.StatusCode.INVALID_ARGUMENT, "replica.url"),
        (stub.AddReplica(_replica("", "http://x:1")), grpc.StatusCode.INVALID_ARGUMENT, "model is empty"),
        (stub.DrainReplica(_replica("toy", "http://x:1")), grpc.StatusCode.NOT_FOUND, "no replica"),
        (stub.RemoveReplica(_replica("toy", "http://x:1")), grpc.StatusCode.NOT_FOUND, "no replica"),
        (stub.GetModel(cpb.GetModelRequest(model="nope")), grpc.StatusCode.NOT_FOUND, "no model 'nope'"),
        (stub.LocateEpisode(cpb.LocateEpisodeRequest()), grpc.StatusCode.INVALID_ARGUMENT, "episode_id"),
        (stub.UpdateWeights(pb.UpdateWeightsRequest(model="")), grpc.StatusCode.INVALID_ARGUMENT, "model is empty"),
        (stub.UpdateWeights(pb.UpdateWeightsRequest(model="nope")), grpc.StatusCode.NOT_FOUND, "no live bridge"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() == code and words in (failed.value.details() or ""), failed.value
    located = await stub.LocateEpisode(cpb.LocateEpisodeRequest(episode_id="ep-unknown"))
    assert located.address == ""
