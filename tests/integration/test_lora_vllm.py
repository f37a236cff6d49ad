"""LoRA adapters on a real vLLM (issue 36, acceptance 3), against transformers + peft.

A vLLM server of this module's own runs with LoRA on (rank <= 8, on the decoder's linear layers: the launch
profile's ``--lora-target-modules``). Two adapters, ``math`` and ``code``, get three versions each through
``UpdateWeights`` with ``adapter`` (each carrying the trainer's proof: the probe's logprobs from transformers + peft
with the same adapter weights); after each round, one greedy episode per adapter. Every episode's trajectory names
its adapter, every token carries the adapter's version at the time it was sampled (an episode opened on version 1 and
stepped again after version 2 committed has both), and the greedy tokens equal transformers + peft's for that adapter
version. Versions no turn uses any more are unloaded from vLLM.

Faults: an adapter update whose weights fail the caller's proof is refused naming the replica, and the adapter keeps
serving its old version (vLLM never serves the new one); a truncated adapter file, a rank above the server's maximum
and LoRA weights for lm_head (vLLM would drop them) fail INVALID_ARGUMENT before vLLM is asked; an unknown adapter in
StartEpisode is INVALID_ARGUMENT naming the loaded ones.

The index (two replicas on the server, the learned prefix index): a prompt cached under one adapter is credited to
neither the other adapter by the bridge's index nor by vLLM's own cache; the same prompt under the same adapter is.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core.salt import salt_text
from engines import make_engines
from engines.config import EngineConfig
from engines.launch import VllmProcess, provision_vllm
from rl_client import WeightProof, weight_proof
from rl_client.errors import FailedPreconditionError, InvalidArgumentError
from tests.integration.engine_script import bridge_over, index_lookup
from tests.integration.lora_adapters import STORY, greedy, make_adapter, with_adapter

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    # peft 0.21 asks transformers 5 a deprecated question while it wraps a model.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
ADAPTERS = ("math", "code")
N = 8  # greedy tokens per turn
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"vllm": {"max_lora_rank": 8}}


@pytest.fixture(scope="module")
def lora_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This module's vLLM server, LoRA on (rank <= 8, runtime loading)."""
    provision_vllm()
    log = tmp_path_factory.mktemp("lora-vllm") / "vllm.log"
    server = VllmProcess.start(str(model_dir), log, env={"PRIMERL_VLLM_LORA_RANK": "8"})
    try:
        server.wait_ready(timeout_s=600)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir)).encode(STORY))


def reference(model_dir: Path, adapter: Path | None, prompt: list[int], n: int) -> tuple[list[int], WeightProof]:
    """transformers + peft with ``adapter``: greedy tokens after ``prompt`` and the proof of the weights."""
    model = with_adapter(model_dir, adapter)
    return greedy(model, prompt, n), weight_proof(model)


async def _served(url: str) -> set[str]:
    """The versions of this test's adapters vLLM serves (the other test's may be loaded too)."""
    async with httpx.AsyncClient(trust_env=False) as http:
        body = (await http.get(f"{url}/v1/models", timeout=30)).json()
    return {m["id"] for m in body["data"] if m["id"].split("@")[0] in ADAPTERS}


async def _wait_served(url: str, want: set[str]) -> None:
    for _ in range(100):  # superseded versions are unloaded in the background once their last turn ended
        if await _served(url) == want:
            return
        await asyncio.sleep(0.1)
    assert await _served(url) == want


async def test_two_adapters_three_versions_each_match_peft(
    lora_url: str, model_dir: Path, prompt: list[int], tmp_path: Path
) -> None:
    dirs = {
        (name, v): make_adapter(model_dir, tmp_path / f"{name}-v{v}", seed=10 * i + v)
        for i, name in enumerate(ADAPTERS)
        for v in (1, 2, 3)
    }
    want = {key: reference(model_dir, d, prompt, N) for key, d in dirs.items()}
    base_tokens, _ = reference(model_dir, None, prompt, N)
    assert len({tuple(t) for t, _ in want.values()} | {tuple(base_tokens)}) == 7  # seven different models
    (engine,) = await make_engines(EngineConfig(type="vllm", urls=[lora_url], model=str(model_dir), **ENGINE))
    async with bridge_over([engine]) as (_, client):
        with pytest.raises(InvalidArgumentError, match="unknown adapter 'math'"):
            await client.start_episode(prompt, adapter="math", sampling=GREEDY)
        spanning = ""  # an episode opened on version 1 of "math", stepped again on version 2
        for v in (1, 2, 3):
            for name in ADAPTERS:
                got = await client.update_weights(str(dirs[name, v]), adapter=name, proof=want[name, v][1])
                assert got == v
            info = (await client.server_info()).models[0]
            assert dict(info.adapters) == {"math": v, "code": v} and info.policy_version == 0
            for name in ADAPTERS:
                started = await client.start_episode(prompt, adapter=name, sampling=GREEDY)
                assert started.policy_version == v
                turn = await client.step(started.episode_id)
                assert list(turn.token_ids) == want[name, v][0], (name, v)
                assert turn.policy_version == v
                if name == "math" and v == 1:
                    spanning = started.episode_id
                    continue
                traj = await client.end_episode(started.episode_id, 1.0)
                assert traj.adapter == name and set(traj.policy_versions.tolist()) == {v}
            if v == 2:
                await client.step(spanning, [42, 43])
                traj = await client.end_episode(spanning, 0.0)
                versions = traj.policy_versions.tolist()
                assert traj.adapter == "math" and versions[: len(prompt) + N] == [1] * (len(prompt) + N)
                assert versions[len(prompt) + N :] == [2] * (2 + N)  # the observation and the second turn: version 2
            await _wait_served(lora_url, {f"math@v{v}", f"code@v{v}"})
        # The base model still serves episodes that name no adapter, at its own version.
        started = await client.start_episode(prompt, sampling=GREEDY)
        turn = await client.step(started.episode_id)
        traj = await client.end_episode(started.episode_id)
        assert list(turn.token_ids) == base_tokens and traj.adapter == "" and set(traj.policy_versions.tolist()) == {0}

        # Faults. Weights that are not what the caller proved: refused naming the replica; version 3 serves on.
        with pytest.raises(FailedPreconditionError) as err:
            await client.update_weights(str(dirs["code", 3]), adapter="math", proof=want["math", 3][1])
        assert engine.info.replica in err.value.details and "version 3 keeps serving" in err.value.details
        truncated = tmp_path / "truncated"
        truncated.mkdir()
        (truncated / "adapter_config.json").write_bytes((dirs["math", 3] / "adapter_config.json").read_bytes())
        data = (dirs["math", 3] / "adapter_model.safetensors").read_bytes()
        (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
        with pytest.raises(InvalidArgumentError, match="not a complete safetensors file"):
            await client.update_weights(str(truncated), adapter="math")
        wide = make_adapter(model_dir, tmp_path / "rank16", seed=99, rank=16)
        with pytest.raises(InvalidArgumentError, match="rank 16 exceeds"):
            await client.update_weights(str(wide), adapter="math")
        with warnings.catch_warnings():  # peft: "a tied layer is part of the adapter" (lm_head is tied here)
            warnings.simplefilter("ignore", UserWarning)
            head = make_adapter(model_dir, tmp_path / "head", seed=98, targets=["q_proj", "lm_head"])
        with pytest.raises(InvalidArgumentError, match="LoRA weights for lm_head, which the server does not apply"):
            await client.update_weights(str(head), adapter="math")
        assert dict((await client.server_info()).models[0].adapters) == {"math": 3, "code": 3}
        await _wait_served(lora_url, {"math@v3", "code@v3"})
        started = await client.start_episode(prompt, adapter="math", sampling=GREEDY)
        assert list((await client.step(started.episode_id)).token_ids) == want["math", 3][0]
        # The OpenAI convention works too: the model name is the adapter's.
        started = await client.start_episode(prompt, model="code", sampling=GREEDY)
        assert list((await client.step(started.episode_id)).token_ids) == want["code", 3][0]
        assert (await client.end_episode(started.episode_id)).adapter == "code"


async def test_the_index_never_credits_one_adapters_blocks_to_another(
    lora_url: str, model_dir: Path, prompt: list[int], tmp_path: Path
) -> None:
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2)
    config = EngineConfig(type="vllm", urls=[lora_url, lora_url], model=str(model_dir), **ENGINE)
    engines = await make_engines(config)  # two replicas: routing consults the bridge's prefix index
    async with httpx.AsyncClient(trust_env=False) as http:  # nothing another test cached
        (await http.post(f"{lora_url}/reset_prefix_cache", timeout=60)).raise_for_status()
    async with bridge_over(engines, cache={"block_size": 32}) as (server, client):
        bridge = server.bridge
        index, fingerprinter = bridge.router.index, bridge.router.fingerprinter
        assert index is not None
        await client.update_weights(str(a), adapter="ta")
        await client.update_weights(str(b), adapter="tb")

        async def cached(adapter: str) -> int:
            """One greedy turn on ``adapter``: the prompt tokens vLLM reports it found in its cache."""
            started = await client.start_episode(prompt, adapter=adapter, sampling=GREEDY)
            step = await client.step(started.episode_id)
            await client.end_episode(started.episode_id)
            return step.usage.cached_tokens

        async def indexed(adapter: str) -> dict[int, int]:
            """The prompt's leading blocks the index holds per replica, under ``adapter``'s salt."""
            salt = salt_text(bridge.info.model, bridge.policy_version, "", bridge.adapters.ref(adapter).served)
            return (await index_lookup(index, fingerprinter.hashes(prompt, salt))).blocks

        first = await cached("ta")  # the prompt's blocks, under ta, on one replica: in the index and in vLLM
        held = {name: await indexed(name) for name in ("ta", "tb")}
        other, again = await cached("tb"), await cached("ta")
        print(f"\nindex blocks {held}; vLLM-cached prompt tokens: ta {first}, then tb {other}, then ta {again}")
        assert held["tb"] == {} and other == 0  # the other adapter: neither the index nor vLLM credits ta's blocks
        assert max(held["ta"].values()) >= 2 and again >= 64  # the same adapter: both do (so the above can fail)


async def test_an_adapter_update_under_rollouts_keeps_the_server_up(
    lora_url: str, model_dir: Path, prompt: list[int], tmp_path: Path
) -> None:
    """Rollouts stream on an adapter while its next version loads and is proven: the proof's prompt-logprobs request
    runs in vLLM's batch beside them (no LoRA on lm_head: ``engines.http.vllm_lora``), so the update commits while a
    long rollout still decodes (on a server that must score alone, it would wait for that rollout to end); every
    rollout ends, its tokens on the version it opened on, and new ones take the new version."""
    dirs = [make_adapter(model_dir, tmp_path / f"r{v}", seed=20 + v) for v in (1, 2)]
    proofs = [reference(model_dir, d, prompt, N)[1] for d in dirs]
    (engine,) = await make_engines(EngineConfig(type="vllm", urls=[lora_url], model=str(model_dir), **ENGINE))
    async with bridge_over([engine]) as (_, client):
        assert await client.update_weights(str(dirs[0]), adapter="roll", proof=proofs[0]) == 1

        async def rollout(seed: int) -> list[int]:
            sampling = {"max_tokens": 48, "temperature": 1.0, "ignore_eos": True, "seed": seed}
            started = await client.start_episode(prompt, adapter="roll", sampling=sampling)
            await client.step(started.episode_id)
            return (await client.end_episode(started.episode_id)).policy_versions.tolist()

        running = [asyncio.create_task(rollout(seed)) for seed in range(3)]
        long = await client.start_episode(prompt, adapter="roll", sampling={**GREEDY, "max_tokens": 1024})
        sentinel = asyncio.create_task(client.step(long.episode_id))  # ~100x longer than the update
        await asyncio.sleep(1.0)  # the rollouts are decoding
        assert await client.update_weights(str(dirs[1]), adapter="roll", proof=proofs[1]) == 2
        assert not sentinel.done()  # the proof did not wait for the replica's running turns
        sentinel.cancel()
        for versions in await asyncio.gather(*running):
            assert set(versions) == {1}  # opened on version 1: every token of it is version 1's
        assert set(await rollout(7)) == {2}
