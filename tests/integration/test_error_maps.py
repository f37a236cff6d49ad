"""Every error of the tree, raised through every app, leaves with its class's HTTP status and gRPC code.

The walk is every subclass of ``core.errors.PrimeRLError``, wherever it is defined (a scan of the source
checks that the walk sees them all). Each app meets the error where it really meets errors, from a
dependency built here to raise the one its request names:

- the bridge's gRPC ``Step`` and its HTTP front door (``POST /inference/v1/generate``): the toy engine,
  failing a request whose first prompt token names the error;
- the verifier's HTTP and gRPC surfaces: a registered grader raising the error its params name (single and
  batch);
- the env hub's OpenEnv app: an environment whose ``reset`` raises the error its task id names;
- LLMServeEnv: an episode archive raising the error the ``/grader`` episode id names;
- the control plane: a fleet store raising the error the ``ListBridges`` model names.

Anything that is not a ``PrimeRLError`` is a bug: INTERNAL / 500, and its message never leaves the server.
"""

from __future__ import annotations

import ast
import errno
import json
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

import core.errors
import envhub.envs._data  # noqa: F401 - defines TaskFileError (no app below imports it)
from core.errors import PrimeRLError
from core.errors_http import openai_error_type
from core.types import GenerateRequest, TokenChunk
from engines.config import ToyConfig
from engines.launch import free_port
from engines.toy import ToyEngine
from envhub.graders import FnGrader, grader_names, register_grader
from envhub.openenv import create_app as openenv_app
from envhub.types import Action, EnvState, ResetResult, StepResult, ToolSpec
from llmserve.app import build_app as llmserve_app
from llmserve.env import EpisodeArchive
from llmserve.models import EpisodeLog
from observability.fleet import ControlMetrics
from placement.registry import BridgeRecord
from proto.primerl.v1 import control_pb2 as cpb
from proto.primerl.v1 import control_pb2_grpc as cpb_grpc
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from proto.primerl.v1 import verifier_pb2 as vpb
from proto.primerl.v1 import verifier_pb2_grpc as vpb_grpc
from rl_client.types import Trajectory as BridgeTrajectory
from server.app import BridgeServer, create_server
from server.config import load_settings
from server.fleet.service import ControlService
from server.http.errors import BadParam
from verifier.app import create_app as verifier_app
from verifier.bridge import BridgeRefused
from verifier.config import VerifierConfig
from verifier.grpc_app import start_grpc
from verifier.service import Verifier

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    *("core", "engines", "cache", "placement", "speculation", "sandbox", "envhub", "observability"),
    *("rl_client", "proto", "grpo", "evals", "verifier", "llmserve", "server"),
)
SECRET = "secret-detail-7f3a"  # a bug's message: it must never reach a client


def _subclasses(cls: type[PrimeRLError]) -> Iterator[type[PrimeRLError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


# Every class of the tree, in a fixed order (index = the name a request carries). A test module may define its
# own subclasses; the apps' errors are the project's (the source scan below names the same set).
ERRORS = sorted(
    {c for c in _subclasses(PrimeRLError) if c.__module__.split(".")[0] in PACKAGES},
    key=lambda c: f"{c.__module__}.{c.__qualname__}",
)
IDS = [c.__qualname__ for c in ERRORS]
BUG = len(ERRORS)  # the index that raises a plain RuntimeError


def make(index: int) -> Exception:
    """A fresh instance of error ``index`` (a ``RuntimeError`` carrying SECRET for ``BUG``)."""
    if index == BUG:
        return RuntimeError(SECRET)
    cls = ERRORS[index]
    message = f"raised on purpose: {cls.__qualname__}"
    if cls is BadParam:
        return BadParam("field", message)
    if cls is BridgeRefused:  # relays another service's code, with the HTTP status of that code's class
        return BridgeRefused("PERMISSION_DENIED", message)
    return cls(message)


def expected(index: int) -> tuple[str, int]:
    """gRPC code name and HTTP status of error ``index``, as its class declares them."""
    exc = make(index)
    if not isinstance(exc, PrimeRLError):
        return "INTERNAL", 500
    return exc.code, exc.http_status


# -- the table itself ------------------------------------------------------------------------------------------


def test_the_walk_sees_every_error_class_in_the_source() -> None:
    """A class added in a module none of the apps imports would escape the walk: the source names them all."""
    bases: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    named = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    bases.setdefault(node.name, set()).update(named)
    found, grew = {"PrimeRLError"}, True
    while grew:
        more = {name for name, b in bases.items() if b & found} - found
        found |= more
        grew = bool(more)
    assert found == set(IDS) and len(IDS) > 20


def test_every_class_names_a_grpc_code_and_an_http_status() -> None:
    for index, cls in enumerate(ERRORS):
        code, status = expected(index)
        assert code in grpc.StatusCode.__members__ and code != "OK", cls
        assert 400 <= status < 600, cls


def test_the_docstring_tree_is_the_table() -> None:
    """core/errors.py draws the tree with both columns: each row is its class's code and status."""
    assert core.errors.__doc__ is not None
    rows = re.findall(r"^\s+[│├└─ ]*(\w+)\s+([A-Z_]+)\s+(\d{3})\b", core.errors.__doc__, flags=re.MULTILINE)
    drawn = {name: (code, int(status)) for name, code, status in rows}
    own = {c.__qualname__: (c.code, c.http_status) for c in ERRORS if c.__module__ == "core.errors"}
    assert drawn == own


# -- the bridge: gRPC Step and the HTTP front door, over an engine that fails -----------------------------------

FIRST = 100  # prompt token FIRST + i: the engine raises error i (the toy vocabulary has 512 ids)


class FailingToy(ToyEngine):
    """The toy engine, failing every request whose first prompt token names an error."""

    def __init__(self) -> None:
        super().__init__(ToyConfig())

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        if request.token_ids[0] >= FIRST:
            raise make(request.token_ids[0] - FIRST)
        async for chunk in super().generate(request):
            yield chunk


@pytest.fixture
async def bridge() -> AsyncIterator[BridgeServer]:
    for attempt in range(3):
        settings = load_settings(server={"port": 0, "grace_period_s": 1.0}, metrics={"port": 0},
                                 http={"port": free_port()})  # fmt: skip
        try:
            server = await create_server(settings, engines=[FailingToy()])
            break
        except OSError as exc:  # the probed HTTP port was taken before the bind (another xdist worker)
            if exc.errno != errno.EADDRINUSE or attempt == 2:
                raise
    await server.start()
    yield server
    await server.stop(0.5)


async def test_bridge_grpc_step_sends_each_class_code(bridge: BridgeServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{bridge.port}") as channel:
        stub = pb_grpc.PrimeRLStub(channel)
        for index in range(BUG + 1):
            prompt = pb.TokenIds(ids=[FIRST + index, 4, 30])
            start = await stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=prompt))
            step = stub.Step(pb.StepRequest(episode_id=start.episode_ids[0], sampling=pb.SamplingParams(max_tokens=3)))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in step:
                    pass
            code, _ = expected(index)
            assert failed.value.code().name == code, (IDS[index] if index < BUG else "bug", failed.value)
            assert SECRET not in (failed.value.details() or "")


async def test_front_door_answers_each_class_status(bridge: BridgeServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bridge.http_port}", timeout=30) as http:
        for index in range(BUG + 1):
            body = {"model": "toy", "token_ids": [FIRST + index, 4, 30], "sampling_params": {"max_tokens": 3}}
            r = await http.post("/inference/v1/generate", json=body)
            _, status = expected(index)
            assert r.status_code == status, (IDS[index] if index < BUG else "bug", r.text)
            error = r.json()["error"]
            assert error["code"] == status and error["type"] == openai_error_type(status), r.text
            assert SECRET not in r.text


# -- the verifier: a grader that raises, over HTTP and gRPC --------------------------------------------------------

GRADER = "test-error-maps-raise"
TRAJECTORY = {
    "episode_id": "ep-1",
    "token_ids": [1, 4, 30, 7, 8],
    "logprobs": [None, None, -0.25, -1.5, None],
    "loss_mask": [0, 0, 1, 1, 0],
    "origins": ["prompt", "prompt", "sampled", "sampled", "env"],
    "policy_versions": [0, 0, 2, 2, 0],
}


def _raise_named(sample: Any) -> float:
    raise make(int(sample.params["error"]))


if GRADER not in grader_names():  # the registry is process-wide: register once
    register_grader(FnGrader(GRADER, _raise_named))


class FailingBridgeSource:
    """A ``--bridge`` whose EndEpisode fails with a bug (the verifier's one route to a non-PrimeRLError)."""

    async def end_episode(self, episode_id: str) -> BridgeTrajectory:
        raise make(BUG)

    async def close(self) -> None:
        pass


@pytest.fixture
async def verifier(tmp_path: Path) -> AsyncIterator[Verifier]:
    config = VerifierConfig(
        database_url=f"sqlite:///{tmp_path / 'log.sqlite3'}", key_dir=str(tmp_path / "keys"), origin="t/log"
    )
    v = await Verifier.open(config)
    v.bridge = FailingBridgeSource()  # type: ignore[assignment]
    yield v
    await v.close()


async def test_verifier_http_answers_each_class_status(verifier: Verifier) -> None:
    transport = httpx.ASGITransport(app=verifier_app(verifier))
    async with httpx.AsyncClient(transport=transport, base_url="http://verifier") as http:
        items = [{"grader": GRADER, "trajectory": TRAJECTORY, "params": {"error": i}} for i in range(BUG)]
        for index, item in enumerate(items):
            r = await http.post("/v1/score", content=json.dumps(item))
            code, status = expected(index)
            assert r.status_code == status and r.json()["error"]["code"] == code, (IDS[index], r.text)
        r = await http.post("/v1/score/batch", content=json.dumps({"items": items}))
        assert [x["error"]["code"] for x in r.json()["results"]] == [expected(i)[0] for i in range(BUG)]


async def test_verifier_grpc_sends_each_class_code(verifier: Verifier) -> None:
    server, port = await start_grpc(verifier, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vpb_grpc.VerifierStub(channel)
            trajectory = pb.Trajectory(
                episode_id="ep-1", token_ids=[1, 4, 30], logprobs=[math.nan, math.nan, -0.25],
                loss_mask=[False, False, True], policy_versions=[0, 0, 2],
                origins=[pb.TOKEN_ORIGIN_PROMPT, pb.TOKEN_ORIGIN_PROMPT, pb.TOKEN_ORIGIN_SAMPLED],
            )  # fmt: skip
            items = [
                vpb.ScoreRequest(grader=GRADER, trajectory=trajectory, params_json=json.dumps({"error": i}))
                for i in range(BUG)
            ]
            for index, item in enumerate(items):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.Score(item)
                assert failed.value.code().name == expected(index)[0], (IDS[index], failed.value)
            batch = await stub.ScoreBatch(vpb.ScoreBatchRequest(items=items))
            assert [r.error.code for r in batch.results] == [expected(i)[0] for i in range(BUG)]
            with pytest.raises(grpc.aio.AioRpcError) as failed:  # the bridge source's bug
                await stub.Score(vpb.ScoreRequest(grader=GRADER, episode_id="ep-1"))
            assert failed.value.code() == grpc.StatusCode.INTERNAL and SECRET not in (failed.value.details() or "")
    finally:
        await server.stop(0)


# -- the OpenEnv apps: the env hub's facade and LLMServeEnv --------------------------------------------------------


class FailingEnv:
    """A hub environment whose reset raises the error its task id names."""

    name = "failing"

    def tools(self) -> tuple[ToolSpec, ...]:
        return ()

    async def reset(self, task_id: str | None = None, seed: int | None = None) -> ResetResult:
        raise make(int(task_id or 0))

    async def step(self, action: Action) -> StepResult:
        raise AssertionError("not reached: reset fails")

    def state(self) -> EnvState:
        return EnvState("failing", "", "", 0, False, 0.0)

    async def close(self) -> None:
        pass


async def test_openenv_hub_app_answers_each_class_status() -> None:
    transport = httpx.ASGITransport(app=openenv_app(FailingEnv, "failing"), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://openenv") as http:
        for index in range(BUG + 1):
            r = await http.post("/reset", json={"task_id": str(index)})
            code, status = expected(index)
            assert r.status_code == status, (IDS[index] if index < BUG else "bug", r.text)
            assert SECRET not in r.text
            if index < BUG:
                assert r.json()["code"] == code, r.text


class FailingArchive(EpisodeArchive):
    """An episode archive whose lookups fail with the error the episode id names."""

    def get(self, episode_id: str | None) -> EpisodeLog | None:
        raise make(int(episode_id or 0))


async def test_llmserve_app_answers_each_class_status() -> None:
    transport = httpx.ASGITransport(app=llmserve_app(FailingArchive()), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://llmserve") as http:
        for index in range(BUG + 1):
            r = await http.post("/grader", json={"episode_id": str(index)})
            _, status = expected(index)
            assert r.status_code == status, (IDS[index] if index < BUG else "bug", r.text)
            assert SECRET not in r.text
            if index < BUG:
                assert r.json()["detail"] == f"raised on purpose: {IDS[index]}", r.text


# -- the control plane ---------------------------------------------------------------------------------------------


class FailingStore:
    """A fleet registry whose reads fail with the error the model name names."""

    async def bridges(self, model: str = "") -> list[BridgeRecord]:
        raise make(int(model))


async def test_control_plane_sends_each_class_code() -> None:
    server = grpc.aio.server()
    cpb_grpc.add_ControlServicer_to_server(ControlService(FailingStore(), ControlMetrics()), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cpb_grpc.ControlStub(channel)
            for index in range(BUG + 1):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.ListBridges(cpb.ListBridgesRequest(model=str(index)))
                assert failed.value.code().name == expected(index)[0], (index, failed.value)
                assert SECRET not in (failed.value.details() or "")
    finally:
        await server.stop(0)
