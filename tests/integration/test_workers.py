"""Several bridge worker processes on one port (``primerl serve --workers N``) and the call forwarder under them.

* ``server.fleet.forward``: a real front server forwards every PrimeRL call to a real toy bridge; the client sees
  the trajectory, status codes, details and metadata it would see calling the bridge directly.
* ``primerl serve --workers 2``: many channels reach both workers (SO_REUSEPORT); an episode started
  through one worker is stepped and ended through the other (forwarded to its owner, proven by the
  ``primerl-worker`` / ``primerl-forwarded-by`` trailers) with the exact trajectory; a killed worker is
  restarted by the parent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.launch import free_port, free_ports
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc
from server.fleet.forward import Forwarder, OwnerUnreachable, Route, passthrough
from tests.conftest import StartBridge
from tests.integration.redis_proc import PrivateRedis

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 4, 30, 31, 32, 2, 5]
SAMPLING = pb.SamplingParams(max_tokens=6, ignore_eos=True, seed=7)
SERVICE = "primerl.v1.PrimeRL"
HOP = (("primerl-hop", "1"),)  # what the front server adds to every call it forwards


async def _front(target: str, forwarder: Forwarder) -> tuple[grpc.aio.Server, int]:
    """A server that forwards every PrimeRL call to ``target`` (what a worker does for another's episode)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, method in pb.DESCRIPTOR.services_by_name["PrimeRL"].methods_by_name.items():
        path = f"/{SERVICE}/{name}"
        if method.server_streaming:

            async def stream(request: bytes, context: Any, path: str = path) -> AsyncIterator[bytes]:
                async for item in forwarder.stream(Route(target, path, metadata=HOP), request, context):
                    yield item

            handlers[name] = grpc.unary_stream_rpc_method_handler(stream, response_serializer=passthrough(None))
        else:

            async def unary(request: bytes, context: Any, path: str = path) -> bytes:
                return await forwarder.unary(Route(target, path, metadata=HOP), request, context)

            handlers[name] = grpc.unary_unary_rpc_method_handler(unary, response_serializer=passthrough(None))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _exact(t: pb.Trajectory) -> tuple[Any, ...]:
    """What must be identical between two runs of one seeded episode (not ids or timings); NaN == NaN."""
    turns = [(x.observation_start, x.generation_start, x.end, x.finish_reason, x.policy_version) for x in t.turns]
    return (list(t.token_ids), [repr(x) for x in t.logprobs], list(t.loss_mask), list(t.origins), turns)


async def _episode(stub: pb_grpc.PrimeRLAsyncStub) -> tuple[list[int], list[int], pb.Trajectory]:
    """Start, two Steps (one streamed), end: the streamed tokens, the unary Step's tokens, the trajectory."""
    started = await stub.StartEpisode(
        pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=SAMPLING)
    )
    ep = started.episode_ids[0]
    streamed = [t async for c in stub.Step(pb.StepRequest(episode_id=ep, stream=True)) for t in c.token_ids]
    step = pb.StepRequest(episode_id=ep, observation_token_ids=pb.TokenIds(ids=[9, 8]))
    unary = [t async for c in stub.Step(step) for t in c.token_ids]
    ended = await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0]))
    return streamed, unary, ended.trajectory


async def test_forwarded_calls_get_the_owners_answers_unchanged(start_bridge: StartBridge) -> None:
    owner, _ = await start_bridge(engine={"type": "toy", "toy": {"seed": 3}})
    forwarder = Forwarder()
    front, port = await _front(f"127.0.0.1:{owner.port}", forwarder)
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{owner.port}") as direct_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as front_channel,
        ):
            direct, via = pb_grpc.PrimeRLStub(direct_channel), pb_grpc.PrimeRLStub(front_channel)
            want = await _episode(direct)
            got = await _episode(via)
            assert got[0] == want[0] and got[1] == want[1] and len(got[0]) == 6
            assert list(got[2].token_ids) == list(want[2].token_ids) == PROMPT + got[0] + [9, 8] + got[1]
            assert _exact(got[2]) == _exact(want[2])

            call = via.Step(pb.StepRequest(episode_id="ep-missing"))  # the owner's status and details, as they are
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in call]
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "ep-missing" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await via.EndEpisode(pb.EndEpisodeRequest(episode_id="ep-missing"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "ep-missing" in (err.value.details() or "")

            started = await via.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT)))
            step = via.Step(pb.StepRequest(episode_id=started.episode_ids[0], stream=True))
            assert ("primerl-accepted", "1") in tuple(await step.initial_metadata())  # the owner's header
            assert [c async for c in step][-1].HasField("done")
    finally:
        await front.stop(0)
        await forwarder.close()


async def test_an_unreachable_owner_is_reported_or_raised() -> None:
    dead = f"unix:{Path('/tmp') / f'primerl-nobody-{os.getpid()}.sock'}"
    forwarder = Forwarder()
    front, port = await _front(dead, forwarder)
    raised: list[BaseException] = []

    async def taker(request: bytes, context: Any) -> bytes:
        try:
            return await forwarder.unary(
                Route(dead, f"/{SERVICE}/GetServerInfo", unreachable_raises=True), request, context
            )
        except OwnerUnreachable as exc:
            raised.append(exc)
            return pb.ServerInfo(server_version="taken over").SerializeToString()

    other = grpc.aio.server()
    other.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"GetServerInfo": grpc.unary_unary_rpc_method_handler(taker)})]
    )
    other_port = other.add_insecure_port("127.0.0.1:0")
    await other.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.PrimeRLStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{other_port}") as channel:
            info = await pb_grpc.PrimeRLStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.server_version == "taken over" and isinstance(raised[0], OwnerUnreachable)
    finally:
        await front.stop(0)
        await other.stop(0)
        await forwarder.close()


class Workers:
    """A real ``primerl serve --workers 2`` (toy engine, persistence in a private Redis) and its log."""

    def __init__(self, log_path: Path, redis_url: str, **extra: str) -> None:
        self.port, self.log_path = free_port(), log_path
        self.http_port, self.metrics_port = free_port(), free_ports(2)  # worker i serves /metrics on metrics.port + i
        env = {
            **os.environ,
            "PRIMERL_HTTP__PORT": str(self.http_port),
            "PRIMERL_ENGINE__TOY__SEED": "3",
            "PRIMERL_REDIS__URL": redis_url,
            "PRIMERL_PERSISTENCE__ENABLED": "true",
            "PRIMERL_SERVER__GRACE_PERIOD_S": "2",
            **extra,
        }
        cmd = [sys.executable, "-m", "server", "serve", "--engine", "toy", "--workers", "2", "--port", str(self.port)]
        with log_path.open("wb") as out:
            cmd += ["--metrics-port", str(self.metrics_port)]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=out, stdout=out)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> dict[int, int]:
        """The newest pid of each worker, as the parent logged it."""
        return {int(w): int(p) for w, p in re.findall(r"worker (\d+) started \(pid (\d+)\)", self.log())}

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(re.findall(pattern, self.log())) < count:
            assert self.proc.poll() is None, f"primerl serve exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {pattern!r} ({count}x) in the log:\n{self.log()}"
            time.sleep(0.2)

    def close(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


@contextmanager
def running_workers(log_path: Path, **extra: str) -> Iterator[Workers]:
    """``Workers`` on a private Redis (``extra``: more PRIMERL_* settings), both serving; on exit they must stop
    cleanly on SIGTERM (exit 0, both stopped), and are killed if they did not."""
    redis = PrivateRedis()
    redis.start()
    proc = Workers(log_path, redis.url, **extra)
    try:
        proc.wait_for(r"worker \d primerl\.server \[-\]: PrimeRL bridge serving", count=2)
        yield proc
        assert proc.close() == 0, proc.log()
        assert "stopping 2 workers" in proc.log()
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)
        redis.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with running_workers(tmp_path_factory.mktemp("workers") / "serve.log") as proc:
        yield proc


async def _by_worker(port: int, stack: AsyncExitStack, want: int = 2) -> dict[int, pb_grpc.PrimeRLAsyncStub]:
    """Channels, each its own TCP connection, until ``want`` workers each hold one (keyed by worker index)."""
    found: dict[int, pb_grpc.PrimeRLAsyncStub] = {}
    for _ in range(64):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        await stack.enter_async_context(channel)
        stub = pb_grpc.PrimeRLStub(channel)
        started = await stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT)), timeout=30)
        ep = started.episode_ids[0]
        await stub.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, discard=True), timeout=30)
        found.setdefault(int(ep.split("-")[1][1:]), stub)
        if len(found) == want:
            return found
    raise AssertionError(f"64 connections reached only workers {sorted(found)}")


def _trailers(metadata: Any) -> dict[str, str]:
    return {k: v for k, v in metadata or () if k.startswith("primerl-")}


async def test_an_episode_is_served_by_its_worker_through_any_connection(workers: Workers) -> None:
    async with AsyncExitStack() as stack:
        stubs = await _by_worker(workers.port, stack)
        for owner, other in ((0, 1), (1, 0)):
            a, b = stubs[owner], stubs[other]
            want = await _episode(a)  # all on the owner
            start = pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=SAMPLING)
            ep = (await a.StartEpisode(start)).episode_ids[0]
            assert ep.startswith(f"ep-w{owner}-")
            call = b.Step(pb.StepRequest(episode_id=ep, stream=True))
            streamed = [t async for c in call for t in c.token_ids]
            assert ("primerl-accepted", "1") in tuple(await call.initial_metadata())
            assert _trailers(await call.trailing_metadata()) == {
                "primerl-worker": str(owner),
                "primerl-forwarded-by": str(other),
            }
            unary = [
                t
                async for c in b.Step(pb.StepRequest(episode_id=ep, observation_token_ids=pb.TokenIds(ids=[9, 8])))
                for t in c.token_ids
            ]
            end = b.EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0]))
            trajectory = (await end).trajectory
            assert _trailers(await end.trailing_metadata())["primerl-worker"] == str(owner)
            assert streamed == want[0] and unary == want[1]
            assert _exact(trajectory) == _exact(want[2])
            assert list(trajectory.token_ids) == PROMPT + streamed + [9, 8] + unary

            with pytest.raises(grpc.aio.AioRpcError) as err:  # the owner's answer, forwarded
                await b.EndEpisode(pb.EndEpisodeRequest(episode_id=ep))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and ep in (err.value.details() or "")
            assert _trailers(err.value.trailing_metadata())["primerl-worker"] == str(owner)


async def test_a_killed_worker_is_restarted_and_its_episode_goes_on(workers: Workers) -> None:
    async with AsyncExitStack() as stack:
        stubs = await _by_worker(workers.port, stack)
        reference = await _episode(stubs[0])
        start = pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=SAMPLING)
        ep = (await stubs[1].StartEpisode(start)).episode_ids[0]
        streamed = [t async for c in stubs[1].Step(pb.StepRequest(episode_id=ep, stream=True)) for t in c.token_ids]

        victim = workers.pids()[1]
        os.kill(victim, signal.SIGKILL)
        workers.wait_for(rf"worker 1 \(pid {victim}\) exited with code -9 .*: restarting; its open episodes resume")
        workers.wait_for(r"worker 1 started \(pid \d+\)", count=2)
        assert workers.pids()[1] != victim

        # Through worker 0: taken over from Redis while worker 1 is down, or forwarded to it once it is back.
        step = pb.StepRequest(episode_id=ep, observation_token_ids=pb.TokenIds(ids=[9, 8]))
        unary = [t async for c in stubs[0].Step(step, timeout=60) for t in c.token_ids]
        trajectory = (
            await stubs[0].EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0]), timeout=60)
        ).trajectory
        assert streamed == reference[0] and unary == reference[1]
        assert _exact(trajectory) == _exact(reference[2])

        workers.wait_for(r"worker 1 primerl\.server \[-\]: PrimeRL bridge serving", count=2)
    async with AsyncExitStack() as stack:
        await _by_worker(workers.port, stack)  # the restarted worker takes connections again


async def test_a_worker_killed_mid_step_leaves_no_lease_behind(tmp_path: Path) -> None:
    """A worker killed while a Step holds its episode's lease: its replacement drops that lease as it starts, so
    once it is up the next Step is served (not refused as busy until ``persistence.lease_ms``, 15 minutes, has
    passed), from the record as it was before the killed Step (whose tokens were never persisted)."""
    # 20 ms a token: a 200-token Step is still running when its worker is killed.
    with running_workers(tmp_path / "serve.log", PRIMERL_ENGINE__TOY__TOKEN_DELAY_S="0.02") as proc:
        async with AsyncExitStack() as stack:
            stubs = await _by_worker(proc.port, stack)
            start = pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT))
            ep = (await stubs[1].StartEpisode(start, timeout=30)).episode_ids[0]
            long = pb.StepRequest(
                episode_id=ep, stream=True, sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)
            )
            call = stubs[1].Step(long, timeout=60)
            assert (await call.read()).token_ids  # streaming: the lease is held
            victim = proc.pids()[1]
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            proc.wait_for(r"worker 1 primerl\.server \[-\]: PrimeRL bridge serving", count=2)  # restarted

            short = pb.SamplingParams(max_tokens=4, ignore_eos=True)
            step = pb.StepRequest(episode_id=ep, observation_token_ids=pb.TokenIds(ids=[9, 8]), sampling=short)
            tokens = [t async for c in stubs[0].Step(step, timeout=60) for t in c.token_ids]
            end = await stubs[0].EndEpisode(pb.EndEpisodeRequest(episode_id=ep, rewards=[1.0]), timeout=60)
            assert len(tokens) == 4 and list(end.trajectory.token_ids) == [*PROMPT, 9, 8, *tokens]
            assert "dropped 1 Step lease(s) that crashed worker 1 held" in proc.log()


async def _versions(stubs: dict[int, pb_grpc.PrimeRLAsyncStub]) -> list[int]:
    """Each worker's policy version, worker 0 first."""
    return [(await stubs[i].GetServerInfo(pb.GetServerInfoRequest())).models[0].policy_version for i in (0, 1)]


async def test_update_weights_reaches_every_worker(workers: Workers) -> None:
    async with AsyncExitStack() as stack:
        stubs = await _by_worker(workers.port, stack)
        before = await _versions(stubs)
        assert before[0] == before[1]
        call = stubs[1].UpdateWeights(pb.UpdateWeightsRequest())
        assert (await call).policy_version == before[0] + 1
        assert await _versions(stubs) == [before[0] + 1] * 2
        want = await _episode(stubs[1])  # the same new weights: the same tokens on either worker
        assert _exact((await _episode(stubs[0]))[2]) == _exact(want[2])


async def test_the_http_weight_routes_reach_every_worker(workers: Workers) -> None:
    """prime-rl's /update_weights and /reload_weights (the HTTP front door runs on worker 0) load the same
    weights on worker 1 at the same version: before, worker 1 kept its old weights."""
    async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=60, trust_env=False) as http:
        stubs = await _by_worker(workers.port, stack)
        base = f"http://127.0.0.1:{workers.http_port}"
        before = await _versions(stubs)
        reply = await http.post(f"{base}/update_weights", json={"weight_dir": "/checkpoints/step-7"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["policy_version"] == before[0] + 1
        assert await _versions(stubs) == [before[0] + 1] * 2
        trained = _exact((await _episode(stubs[1]))[2])
        assert _exact((await _episode(stubs[0]))[2]) == trained  # the same new weights on either worker

        reply = await http.post(f"{base}/reload_weights")
        assert reply.status_code == 200, reply.text
        assert await _versions(stubs) == [before[0] + 2] * 2
        reloaded = _exact((await _episode(stubs[1]))[2])
        assert _exact((await _episode(stubs[0]))[2]) == reloaded != trained  # both back on the base weights


async def test_a_call_for_a_dead_workers_episode_says_it_was_lost(tmp_path: Path) -> None:
    """In process, worker 0 of 2 whose peer never started: without persistence its episodes are gone."""
    from server.app import create_server
    from server.config import load_settings
    from server.fleet.workers import WorkerSlot

    slot = WorkerSlot(0, (f"unix:{tmp_path}/w0.sock", f"unix:{tmp_path}/w1.sock"))
    settings = load_settings(engine={"type": "toy"}, server={"port": 0, "grace_period_s": 0.5}, metrics={"port": 0})
    server = await create_server(settings, worker=slot)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub: pb_grpc.PrimeRLAsyncStub = pb_grpc.PrimeRLStub(channel)
            for call in (
                lambda: _drain(stub.Step(pb.StepRequest(episode_id="ep-w1-0123"))),
                lambda: stub.EndEpisode(pb.EndEpisodeRequest(episode_id="ep-w1-0123")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "worker 1" in (err.value.details() or "") and "persistence" in (err.value.details() or "")
            # Already forwarded once: served here, never a second hop (this worker does not hold it).
            hop = (("primerl-forwarded-by", "1"),)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.EndEpisode(pb.EndEpisodeRequest(episode_id="ep-w1-0123"), metadata=hop)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            started = await stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT)))
            assert started.episode_ids[0].startswith("ep-w0-")
    finally:
        await server.stop(0.5)
        from server.fleet.forward import default_forwarder

        await default_forwarder().close()


async def _drain(call: Any) -> list[Any]:
    return [c async for c in call]


async def test_each_worker_serves_its_metrics_and_worker_0_the_http_front_door(workers: Workers) -> None:
    async with AsyncExitStack() as stack:
        stubs = await _by_worker(workers.port, stack)
        for stub in stubs.values():
            await _episode(stub)
    async with httpx.AsyncClient(timeout=30) as http:
        pages = [(await http.get(f"http://127.0.0.1:{workers.metrics_port + i}/metrics")).text for i in (0, 1)]
        for page in pages:  # each worker counts the Steps it ran (the episodes above: two on each)
            steps = [
                s.value
                for f in text_string_to_metric_families(page)
                for s in f.samples
                if s.name == "primerl_rpc_handled_total" and s.labels.get("method", "").endswith("/Step")
            ]
            assert sum(steps) >= 2, page[:2000]
        models = await http.get(f"http://127.0.0.1:{workers.http_port}/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"]


async def test_forwarding_passes_the_callers_token(start_bridge: StartBridge) -> None:
    from server.auth import hash_token

    owner, _ = await start_bridge(auth={"token_hashes": [f"alice:{hash_token('a-token')}", f"bob:{hash_token('b')}"]})
    forwarder = Forwarder()
    front, port = await _front(f"127.0.0.1:{owner.port}", forwarder)
    alice = (("authorization", "Bearer a-token"),)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub: pb_grpc.PrimeRLAsyncStub = pb_grpc.PrimeRLStub(channel)
            start = pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=SAMPLING)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no token: the owner refuses, as it would directly
                await stub.StartEpisode(start)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ep = (await stub.StartEpisode(start, metadata=alice)).episode_ids[0]
            bob = (("authorization", "Bearer b"),)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the owner sees bob's token, not the front's
                await _drain(stub.Step(pb.StepRequest(episode_id=ep), metadata=bob))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert len(await _drain(stub.Step(pb.StepRequest(episode_id=ep), metadata=alice))) == 1
    finally:
        await front.stop(0)
        await forwarder.close()


async def test_the_owner_gets_the_callers_deadline_and_metadata() -> None:
    async def echo(request: bytes, context: Any) -> bytes:
        md = dict(context.invocation_metadata())
        seen = f"{context.time_remaining():.3f}|{md.get('x-request-id')}|{md.get('primerl-hop')}"
        return pb.ServerInfo(server_version=seen).SerializeToString()

    owner = grpc.aio.server()
    owner.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"GetServerInfo": grpc.unary_unary_rpc_method_handler(echo)})]
    )
    owner_port = owner.add_insecure_port("127.0.0.1:0")
    await owner.start()
    forwarder = Forwarder()
    front, port = await _front(f"127.0.0.1:{owner_port}", forwarder)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub: pb_grpc.PrimeRLAsyncStub = pb_grpc.PrimeRLStub(channel)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=20, metadata=(("x-request-id", "r-1"),))
        remaining, request_id, hop = info.server_version.split("|")
        # <= 20.2: gRPC encodes each hop's timeout rounded up (to 100 ms at this size); seen 20.099 once.
        assert 10 < float(remaining) <= 20.2 and request_id == "r-1" and hop == "1"
    finally:
        await front.stop(0)
        await owner.stop(0)
        await forwarder.close()
