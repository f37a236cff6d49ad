"""The request id of an RPC (set by the server's interceptor) reaches the engine request, the logs and the span.

A client that sends ``x-request-id`` finds its id in the engine's request ids (one per turn:
``<id>-<turn>-<n>``) and in every log line the bridge wrote while serving the call; a client that sends
none gets a fresh id per call. The engine here is the real toy engine, subclassed only to keep the
request ids it was asked to generate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from core.types import GenerateRequest, TokenChunk
from engines.config import ToyConfig
from engines.toy import ToyEngine
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from server.app import create_server
from server.config import load_settings
from server.requestid import RequestIdFilter

PROMPT = [1, 4, 30, 31, 32, 2, 5]


class RecordingToy(ToyEngine):
    def __init__(self) -> None:
        super().__init__(ToyConfig(supports_weight_updates=True))
        self.request_ids: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.request_ids.append(request.request_id)
        async for chunk in super().generate(request):
            yield chunk


@pytest.fixture
async def served() -> AsyncIterator[tuple[RecordingToy, pb_grpc.PrimeRLStub]]:
    engine = RecordingToy()
    server = await create_server(load_settings(server={"port": 0}, metrics={"port": 0}), engines=[engine])
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield engine, pb_grpc.PrimeRLStub(channel)
    await server.stop(0.5)


async def _step(stub: pb_grpc.PrimeRLStub, episode_id: str, metadata: Any = ()) -> None:
    sampling = pb.SamplingParams(max_tokens=3, ignore_eos=True)
    async for _ in stub.Step(pb.StepRequest(episode_id=episode_id, sampling=sampling), metadata=metadata):
        pass


async def test_the_clients_request_id_names_each_engine_request(
    served: tuple[RecordingToy, pb_grpc.PrimeRLStub],
) -> None:
    engine, stub = served
    start = await stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT)))
    episode = start.episode_ids[0]
    await _step(stub, episode, (("x-request-id", "trainer-7f3a"),))
    await _step(stub, episode, (("x-request-id", "trainer-7f3b"),))
    await _step(stub, episode)  # no id sent: the server makes one
    await _step(stub, episode)
    calls = [rid.rsplit("-", 2) for rid in engine.request_ids]  # <call's id>-<turn>-<n>
    assert [c[:2] for c in calls[:2]] == [["trainer-7f3a", "0"], ["trainer-7f3b", "1"]]
    assert all(len(c[0]) == 32 for c in calls[2:]) and calls[2][0] != calls[3][0], engine.request_ids
    assert len(set(engine.request_ids)) == 4


async def test_concurrent_calls_with_one_client_id_get_distinct_engine_ids(
    served: tuple[RecordingToy, pb_grpc.PrimeRLStub],
) -> None:
    """Engines key requests by id: a client reusing its x-request-id on concurrent calls must not collide."""
    engine, stub = served
    start = await stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), group_size=4))
    same = (("x-request-id", "same"),)
    await asyncio.gather(*(_step(stub, ep, same) for ep in start.episode_ids))
    assert len(engine.request_ids) == 4 and len(set(engine.request_ids)) == 4
    assert all(rid.startswith("same-0-") for rid in engine.request_ids)


async def test_log_lines_written_during_a_call_carry_its_request_id(
    served: tuple[RecordingToy, pb_grpc.PrimeRLStub], caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    _, stub = served
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="primerl.server"):
        await stub.UpdateWeights(pb.UpdateWeightsRequest(policy_version=1), metadata=(("x-request-id", "upd-1"),))
    logged = [r for r in caplog.records if "weights updated" in r.getMessage()]
    assert logged and logged[0].request_id == "upd-1"  # type: ignore[attr-defined]
    outside = logging.LogRecord("primerl.server", logging.INFO, __file__, 1, "outside", None, None)
    assert RequestIdFilter().filter(outside) and outside.request_id == "-"  # type: ignore[attr-defined]
