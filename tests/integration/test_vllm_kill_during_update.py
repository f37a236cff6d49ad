"""A real vLLM replica SIGKILLed during a weight update's apply (issue 36, acceptance 1, the third fault).

One bridge over two real vLLM replicas: the session's server (A, tests/integration/conftest.py; its base weights are
restored after) and one of this test's own (B, killed). ``UpdateWeights`` with the trainer's proof starts; once the
pause begins (A swaps in the weights it staged, B reloads in place), B is SIGKILLed (API server and engine core). The
update commits on A (the call reports B's failure: UNAVAILABLE naming it), B is fenced (out of rotation, its version
not counted), and every token sampled meanwhile and after carries a committed version: A's next turn and ScoreTokens
are the new weights', at version 1. Then B restarts on its start-up weights: the health check reloads it with the
committed checkpoint and proves it before it serves; its scores equal A's.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines import make_engines
from engines.config import EngineConfig
from engines.launch import VllmProcess, free_port
from engines.model_store import load_model_and_tokenizer
from engines.scoring import ScoreRequest
from rl_client import weight_proof
from rl_client.errors import UnavailableError
from tests.integration.engine_script import bridge_over
from tests.integration.test_engine_vllm import perturbed_checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]
PROBE = tuple(range(100, 140))
IN_PLACE = {"PRIMERL_VLLM_STAGED_RELOAD": "0"}  # scripts/serve_vllm.sh without the worker extension


@pytest.fixture
def own_vllm(model_dir: Path, tmp_path: Path) -> Iterator[tuple[list[VllmProcess], int]]:
    """Replica B: a vLLM server of this test's own (it gets killed and restarted on the same port)."""
    port = free_port()
    # Without the staging extension: B reloads in place (~0.5 s), long enough to be killed during it, and a server
    # without the extension is shown to take updates (the session's A stages and swaps).
    servers = [VllmProcess.start(str(model_dir), tmp_path / "vllm-b1.log", port=port, env=IN_PLACE)]
    try:
        servers[0].wait_ready(timeout_s=600)
        yield servers, port
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def shared_vllm(vllm_url: str, model_dir: Path) -> Iterator[str]:
    """Replica A: the session's server, its base weights restored after (the test loads perturbed ones)."""
    try:
        yield vllm_url
    finally:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}, "timeout": 600}
        httpx.post(f"{vllm_url}/collective_rpc", json=body, timeout=600, trust_env=False).raise_for_status()
        httpx.post(f"{vllm_url}/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()


async def test_a_replica_killed_during_apply_is_fenced_the_other_commits_and_it_rejoins_proven(
    shared_vllm: str, own_vllm: tuple[list[VllmProcess], int], model_dir: Path, tmp_path: Path
) -> None:
    servers, port = own_vllm
    b = servers[0]
    config = EngineConfig(type="vllm", urls=[shared_vllm, b.url], model="smollm2", vllm={"connect_retries": 0})
    engines = await make_engines(config)
    ckpt = perturbed_checkpoint(model_dir, tmp_path / "trained")
    model, _ = load_model_and_tokenizer(model_dir)
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    proof = weight_proof(model)
    async with bridge_over(engines, metrics={"port": 0, "health_interval_s": 600}) as (server, client):
        bridge = server.bridge
        base = (await engines[0].score(ScoreRequest(PROBE, 1))).logprobs.tolist()
        update = asyncio.create_task(client.update_weights(str(ckpt), proof=proof))
        while bridge.weights.steady and not update.done():  # noqa: ASYNC110 - prepare: checked, A stages
            await asyncio.sleep(0.005)
        assert not update.done()  # the pause began: A swaps, B reloads in place
        os.killpg(os.getpgid(b.process.pid), signal.SIGKILL)  # API server and engine core
        b.process.wait(30)
        with pytest.raises(UnavailableError) as failed:
            await update
        print(f"\nUpdateWeights with replica B SIGKILLed during apply: {failed.value}")
        assert "weights updated to version 1 on" in failed.value.details
        assert engines[1].info.replica in failed.value.details.split("failed on")[1]
        assert bridge.policy_version == 1 and bridge.weights.tainted == {1}
        assert bridge.router.replicas.healthy == [True, False]  # fenced
        trained = (await engines[0].score(ScoreRequest(PROBE, 1))).logprobs.tolist()
        assert trained != pytest.approx(base, abs=1e-3)
        started = await client.start_episode(list(PROBE), sampling={"max_tokens": 4, "temperature": 0.0})
        assert started.policy_version == 1 and started.replica == engines[0].info.replica
        await client.step(started.episode_id)
        traj = await client.end_episode(started.episode_id)
        assert set(traj.policy_versions.tolist()) == {1}

        servers.append(VllmProcess.start(str(model_dir), tmp_path / "vllm-b2.log", port=port, env=IN_PLACE))
        servers[-1].wait_ready(timeout_s=600)  # B again, on its start-up weights
        assert await server.check_health()
        assert bridge.router.replicas.healthy == [True, True] and bridge.weights.tainted == set()
        again = (await engines[1].score(ScoreRequest(PROBE, 1))).logprobs.tolist()
        assert again == pytest.approx(trained, abs=1e-4)  # reloaded with the committed checkpoint, proven
