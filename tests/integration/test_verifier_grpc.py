"""``primerl verifier serve``'s gRPC surface (``primerl.v1.Verifier``) on a free port, next to its HTTP JSON.

A real server, real gRPC channels: Score and ScoreBatch sign into the same log the HTTP surface serves
(the same subject digest for the same trajectory over either surface), bad input is INVALID_ARGUMENT
naming the field, batch items fail alone on their own deadline, health and reflection answer, and an
episode id on a real (toy-engine) bridge is ended there and graded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from engines.launch import free_port
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import verifier_pb2 as vpb
from proto.primerl.v1 import verifier_pb2_grpc as vpb_grpc
from tests.conftest import StartBridge
from tests.integration.test_verifier_http import TRAJECTORY, post
from verifier.cli import serve
from verifier.config import VerifierConfig
from verifier.grpc_app import trajectory_json

PB_TRAJECTORY = pb.Trajectory(
    episode_id="ep-1",
    token_ids=[1, 4, 30, 7, 8],
    logprobs=[math.nan, math.nan, -0.25, -1.5, math.nan],
    loss_mask=[False, False, True, True, False],
    origins=[1, 1, 3, 3, 2],
    policy_versions=[0, 0, 2, 2, 0],
    rewards=[9.0],  # not graded, not signed
)


class Served:
    def __init__(self, target: str, channel: grpc.aio.Channel, http: httpx.AsyncClient) -> None:
        self.target, self.channel, self.http = target, channel, http
        self.stub = vpb_grpc.VerifierStub(channel)


async def _start(tmp_path: Path, **overrides: Any) -> AsyncIterator[Served]:
    grpc_port = free_port()
    config = VerifierConfig(
        http_port=free_port(),
        grpc_port=grpc_port,
        database_url=f"sqlite:///{tmp_path / 'log.sqlite3'}",
        key_dir=str(tmp_path / "keys"),
        grader_timeout_s=2.0,
        origin="t/log",
        **overrides,
    )
    ready = asyncio.Event()
    task = asyncio.create_task(serve(config, ready), name="verifier-under-test")
    await asyncio.wait_for(ready.wait(), 30)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}", timeout=10) as http,
    ):
        yield Served(f"127.0.0.1:{grpc_port}", channel, http)
    if task.done():
        task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def verifier(tmp_path: Path) -> AsyncIterator[Served]:
    async for served in _start(tmp_path):
        yield served


def _req(value: float, **kw: Any) -> vpb.ScoreRequest:
    kw.setdefault("trajectory", PB_TRAJECTORY)
    return vpb.ScoreRequest(grader="constant", params_json=json.dumps({"value": value}), **kw)


def _statement(envelope_json: str) -> dict[str, Any]:
    return json.loads(base64.b64decode(json.loads(envelope_json)["payload"]))


async def test_score_over_grpc_signs_what_http_serves(verifier: Served) -> None:
    got = await verifier.stub.Score(_req(0.75), timeout=10)
    assert got.reward == 0.75 and got.receipt.log_index == 0 and len(got.receipt.leaf_hash) == 32
    entry = (await verifier.http.get("/v1/log/entries/0")).json()
    assert json.loads(got.receipt.envelope_json) == entry["envelope"]  # the logged entry is the receipt's
    over_http = (
        await post(
            verifier.http, "/v1/score", {"grader": "constant", "trajectory": TRAJECTORY, "params": {"value": 0.75}}
        )
    ).json()
    a, b = (
        _statement(got.receipt.envelope_json),
        json.loads(base64.b64decode(over_http["receipt"]["envelope"]["payload"])),
    )
    assert a["subject"] == b["subject"]  # one canonical encoding whichever surface carried the trajectory
    a["predicate"].pop("timings"), b["predicate"].pop("timings")
    assert a == b


BAD = [
    (vpb.ScoreRequest(grader="constant", params_json='{"value": 1}'), "trajectory"),
    (_req(1, trajectory=pb.Trajectory(episode_id="e", token_ids=[1, 2], logprobs=[0.0])), "logprobs has 1 entries"),
    (
        _req(
            1,
            trajectory=pb.Trajectory(token_ids=[1], logprobs=[0.0], loss_mask=[True], origins=[3], policy_versions=[0]),
        ),
        "trajectory.episode_id",
    ),
    (
        _req(
            1,
            trajectory=pb.Trajectory(
                episode_id="e", token_ids=[1], logprobs=[0.0], loss_mask=[True], origins=[0], policy_versions=[0]
            ),
        ),
        "trajectory.origins.0",
    ),
    (vpb.ScoreRequest(grader="nope", trajectory=PB_TRAJECTORY), "unknown grader"),
    (vpb.ScoreRequest(grader="constant", trajectory=PB_TRAJECTORY, params_json="{x"), "params_json"),
    (vpb.ScoreRequest(grader="constant", trajectory=PB_TRAJECTORY, params_json="[1]"), "params"),
    (vpb.ScoreRequest(grader="constant", trajectory=PB_TRAJECTORY), "params.value"),
    (vpb.ScoreRequest(trajectory=PB_TRAJECTORY, params_json='{"value": 1}'), "grader"),
    (_req(1, timeout_s=-1), "timeout_s"),
]


async def test_bad_input_is_invalid_argument_naming_the_field_and_appends_nothing(verifier: Served) -> None:
    for request, field in BAD:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await verifier.stub.Score(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert field in (err.value.details() or ""), (field, err.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await verifier.stub.ScoreBatch(vpb.ScoreBatchRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:  # no --bridge: scoring by episode id cannot be done here
        await verifier.stub.Score(vpb.ScoreRequest(grader="constant", episode_id="e"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--bridge" in (err.value.details() or "")
    assert (await verifier.http.get("/v1/log/checkpoint")).json()["tree_size"] == 0


async def test_batch_items_fail_alone_on_their_own_deadline(verifier: Served) -> None:
    slow = vpb.ScoreRequest(grader="test-slow", trajectory=PB_TRAJECTORY, timeout_s=0.2)  # test_verifier_http's 1 s
    bad = vpb.ScoreRequest(grader="nope", trajectory=PB_TRAJECTORY)
    got = await verifier.stub.ScoreBatch(vpb.ScoreBatchRequest(items=[_req(1.0), slow, bad, _req(2.0)]), timeout=10)
    kinds = [r.WhichOneof("outcome") for r in got.results]
    assert kinds == ["scored", "error", "error", "scored"]
    assert got.results[1].error.code == "DEADLINE_EXCEEDED" and "timeout_s=0.2" in got.results[1].error.message
    assert got.results[2].error.code == "INVALID_ARGUMENT" and "unknown grader" in got.results[2].error.message
    assert [got.results[i].scored.receipt.log_index for i in (0, 3)] == [0, 1]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the call's own deadline bounds the grader's
        await verifier.stub.Score(vpb.ScoreRequest(grader="test-slow", trajectory=PB_TRAJECTORY), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_health_and_reflection(verifier: Served) -> None:
    health = health_pb2_grpc.HealthStub(verifier.channel)
    for service in ("", "primerl.v1.Verifier"):
        got = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING

    def reflect(target: str) -> tuple[list[str], list[str]]:
        with grpc.insecure_channel(target) as sync_channel:
            db = ProtoReflectionDescriptorDatabase(sync_channel)
            services = list(db.get_services())
            methods = [m.name for m in db.FindFileContainingSymbol("primerl.v1.Verifier").service[0].method]
            return services, methods

    services, methods = await asyncio.to_thread(reflect, verifier.target)
    assert "primerl.v1.Verifier" in services and "grpc.health.v1.Health" in services
    assert methods == ["Score", "ScoreBatch"]


async def test_score_by_episode_id_ends_it_on_the_bridge(start_bridge: StartBridge, tmp_path: Path) -> None:
    server, client = await start_bridge()
    started = await client.start_episode([1, 2, 3], sampling={"max_tokens": 4, "temperature": 0})
    await client.step(started.episode_ids[0])
    episode = started.episode_ids[0]
    async for verifier in _start(tmp_path, bridge=f"127.0.0.1:{server.port}"):
        got = await verifier.stub.Score(
            vpb.ScoreRequest(grader="constant", episode_id=episode, params_json='{"value": 1}'), timeout=10
        )
        t = got.trajectory
        assert got.reward == 1.0 and t.episode_id == episode and list(t.token_ids[:3]) == [1, 2, 3]
        assert len(t.token_ids) == 7 and list(t.loss_mask) == [False] * 3 + [True] * 4
        statement = _statement(got.receipt.envelope_json)
        assert statement["subject"][0]["name"] == f"trajectory:{episode}"
        over_http = (
            await post(
                verifier.http,
                "/v1/score",
                {"grader": "constant", "params": {"value": 1}, "trajectory": trajectory_json(t)},
            )
        ).json()
        assert (
            json.loads(base64.b64decode(over_http["receipt"]["envelope"]["payload"]))["subject"] == statement["subject"]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:  # ended by the first score: the bridge no longer has it
            await verifier.stub.Score(
                vpb.ScoreRequest(grader="constant", episode_id=episode, params_json='{"value": 1}'), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "episode_id" in (err.value.details() or "")


async def test_the_grpo_rater_is_a_grader_the_service_finds_by_entry_point(verifier: Served) -> None:
    """The project declares the GRPO demo's rater under primerl.graders; the served verdict is the trainer's reward."""
    from envhub import ToolResult
    from grpo.rater import Rollout
    from grpo.tasks import arithmetic_rater

    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>', "Answer: 5"]
    for answer, ok in (("5", True), ("6", False)):
        rollout = Rollout(turns, [ToolResult("calculator", "5")], answer)
        params = {"turns": turns, "tool_results": [{"name": "calculator", "content": "5"}], "reference": answer}
        got = await verifier.stub.Score(
            vpb.ScoreRequest(grader="grpo-arithmetic", trajectory=PB_TRAJECTORY, params_json=json.dumps(params)),
            timeout=10,
        )
        assert got.reward == pytest.approx(arithmetic_rater()(rollout))
        assert (got.reward == pytest.approx(1.0)) is ok
