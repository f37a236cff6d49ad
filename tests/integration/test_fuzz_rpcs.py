"""Property-based fuzzing of every RPC, in random orders, against a real bridge process (toy engine).

A hypothesis state machine sends StartEpisode / Step / EndEpisode / UpdateWeights / GetServerInfo
with random and malformed field values (negative, huge and out-of-vocabulary ids, NaN and infinite
floats, unknown episode ids, invalid JSON tool schemas, unknown roles, tiny deadlines) to a bridge
running in its own process. Every call must end with OK or a status a user can act on: never
INTERNAL or UNKNOWN, and the bridge must stay healthy and serve a normal episode afterwards.
``PRIMERL_FUZZ_EXAMPLES`` scales the run (default: 500 programs of up to 25 calls: over 10,000 fuzzed calls,
each followed by a GetServerInfo check).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from engines.launch import free_port
from proto.primerl.v1 import primerl_pb2 as pb
from proto.primerl.v1 import primerl_pb2_grpc as pb_grpc

EXAMPLES = int(os.environ.get("PRIMERL_FUZZ_EXAMPLES", "500"))
STEPS = 25
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CALLS: list[int] = [0]

int32 = st.integers(-(2**31), 2**31 - 1)
ids = st.lists(st.one_of(st.integers(0, 600), int32), max_size=40)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(-2, 3, width=32))
text = st.text(max_size=30)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "robot", "USER"])
messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=text, name=text), max_size=4)


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    p = pb.SamplingParams()
    for name, strategy in (
        ("temperature", floats),
        ("top_p", floats),
        ("top_k", int32),
        ("max_tokens", st.one_of(st.integers(-2, 40), int32)),
        ("seed", st.integers(0, 2**64 - 1)),
        ("ignore_eos", st.booleans()),
        ("raw_logprobs", st.booleans()),
    ):
        if draw(st.booleans()):
            setattr(p, name, draw(strategy))
    p.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 600), int32), max_size=3)))
    return p


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--engine", "toy", "--port", str(port), "--metrics-port", "0"]
    # The bridge's log goes to a file: a pipe nobody reads until the end fills up (64 KiB) and blocks its writes.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stderr=log, text=True)
        chan = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            grpc.channel_ready_future(chan).result(timeout=60)
            yield chan
        finally:
            chan.close()
            proc.terminate()
            proc.wait(timeout=30)
            log.seek(0)
            err = log.read()
    assert "Traceback" not in err, err[-3000:]  # no handler crashed, even where the status was fine


def _check(call: Any) -> Any:
    CALLS[0] += 1
    try:
        return call()
    except grpc.RpcError as err:
        code = err.code()
        assert code not in FORBIDDEN, f"{code}: {err.details()}"
        assert err.details(), f"{code} without a message"
        return None


def make_machine(stub: pb_grpc.PrimeRLStub) -> type[RuleBasedStateMachine]:
    class Bridge(RuleBasedStateMachine):
        episodes = Bundle("episodes")

        @rule(
            target=episodes,
            model=st.sampled_from(["", "toy", "nope"]),
            prompt=st.one_of(ids.map(lambda x: ("ids", x)), messages.map(lambda m: ("messages", m))),
            tools=st.lists(st.sampled_from(['{"name": "calc"}', "{not json", ""]), max_size=2),
            params=sampling(),
            group_size=st.one_of(st.integers(-1, 4), int32),
            group_id=st.sampled_from(["", "g1", "g2"]),
        )
        def start(self, model: str, prompt: Any, tools: list[str], params: Any, group_size: int, group_id: str) -> str:
            req = pb.StartEpisodeRequest(
                model=model, sampling=params, group_size=group_size, group_id=group_id, tool_schemas_json=tools
            )
            kind, value = prompt
            if kind == "ids":
                req.prompt_token_ids.ids.extend(value)
            else:
                req.prompt_messages.messages.extend(value)
            reply = _check(lambda: stub.StartEpisode(req, timeout=10))
            return reply.episode_ids[0] if reply is not None and reply.episode_ids else "ep-unknown"

        @rule(
            episode=st.one_of(episodes, st.sampled_from(["", "ep-0", "x" * 300])),
            obs=st.one_of(st.none(), ids, messages),
            params=sampling(),
            stream=st.booleans(),
            deadline=st.sampled_from([10.0, 10.0, 0.001]),
        )
        def step(self, episode: str, obs: Any, params: Any, stream: bool, deadline: float) -> None:
            req = pb.StepRequest(episode_id=episode, sampling=params, stream=stream)
            if obs and isinstance(obs[0], int):
                req.observation_token_ids.ids.extend(obs)
            elif obs:
                req.observation_messages.messages.extend(obs)

            def call() -> None:
                for _ in stub.Step(req, timeout=deadline):
                    pass

            _check(call)

        @rule(
            episode=st.one_of(episodes, st.sampled_from(["", "ep-0"])),
            rewards=st.lists(floats, max_size=3),
            turn_rewards=st.lists(floats, max_size=3),
            discard=st.booleans(),
        )
        def end(self, episode: str, rewards: list[float], turn_rewards: list[float], discard: bool) -> None:
            req = pb.EndEpisodeRequest(episode_id=episode, rewards=rewards, turn_rewards=turn_rewards, discard=discard)
            _check(lambda: stub.EndEpisode(req, timeout=10))

        @rule(
            model=st.sampled_from(["", "nope"]),
            path=st.sampled_from(["", "/nonexistent", "relative/dir"]),
            version=st.one_of(st.integers(-2, 5), st.integers(-(2**63), 2**63 - 1)),
            keep_kv=st.booleans(),
        )
        def update(self, model: str, path: str, version: int, keep_kv: bool) -> None:
            req = pb.UpdateWeightsRequest(model=model, checkpoint_path=path, policy_version=version, keep_kv=keep_kv)
            _check(lambda: stub.UpdateWeights(req, timeout=10))

        @invariant()
        def serves_info(self) -> None:
            assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).models

    return Bridge


@pytest.mark.slow
def test_fuzz_every_rpc_never_internal(channel: grpc.Channel) -> None:
    stub = pb_grpc.PrimeRLStub(channel)
    machine = make_machine(stub)
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    started = time.perf_counter()
    machine.TestCase().runTest()
    print(f"\nfuzz: {CALLS[0]} RPCs in {time.perf_counter() - started:.1f} s")
    assert CALLS[0] >= EXAMPLES * 20  # the programs ran their calls (10,000 in the default profile)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ok = stub.StartEpisode(pb.StartEpisodeRequest(prompt_token_ids=pb.TokenIds(ids=[1, 4, 30])), timeout=10)
    chunks = list(stub.Step(pb.StepRequest(episode_id=ok.episode_ids[0]), timeout=10))
    assert chunks[-1].HasField("done")
