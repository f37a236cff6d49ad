"""LoRA adapters on the embedded engine (issue 36): several at once, each batch row with its own, equal to peft.

Two adapters, two versions each, through ``UpdateWeights`` with ``adapter`` and the caller's transformers + peft
proof. Per version, three greedy episodes run at once (one per adapter and one on the base model), so their decode
steps share batched forwards with a different adapter on each row: every episode's tokens equal transformers + peft's
(or the base model's) and carry its adapter's version; ScoreTokens with an adapter equals peft's logprobs. A wrong
proof leaves the old version serving; a malformed adapter is INVALID_ARGUMENT naming the tensor; a version that no
turn uses any more is unloaded.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from engines.model_store import ensure_converted
from rl_client.errors import FailedPreconditionError, InvalidArgumentError
from tests.integration.lora_adapters import STORY, greedy, make_adapter, with_adapter

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
N = 8
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}


async def test_two_adapters_in_one_batch_match_peft(start_bridge: object, tmp_path: Path) -> None:
    model_dir = Path(ensure_converted())
    server, client = await start_bridge(engine={"type": "embedded"})  # type: ignore[operator]
    engine = server.bridge.engines[0]
    prompt = engine.tokenizer.encode(STORY)
    dirs = {(name, v): make_adapter(model_dir, tmp_path / f"{name}{v}", seed=10 * i + v)
            for i, name in enumerate(("a", "b")) for v in (1, 2)}  # fmt: skip
    models = {key: with_adapter(model_dir, d) for key, d in dirs.items()}
    want = {key: greedy(m, prompt, N) for key, m in models.items()}
    base = greedy(with_adapter(model_dir, None), prompt, N)
    assert len({tuple(t) for t in want.values()} | {tuple(base)}) == 5
    from rl_client import weight_proof

    async def episode(adapter: str) -> tuple[list[int], list[int], str]:
        started = await client.start_episode(prompt, adapter=adapter, sampling=GREEDY)
        turn = await client.step(started.episode_id)
        traj = await client.end_episode(started.episode_id)
        return list(turn.token_ids), traj.policy_versions.tolist(), traj.adapter

    batched_before = engine.counters.extra.get("batched_rows", 0)
    for v in (1, 2):
        for name in ("a", "b"):
            proof = weight_proof(models[name, v])
            assert await client.update_weights(str(dirs[name, v]), adapter=name, proof=proof) == v
        got = await asyncio.gather(episode("a"), episode("b"), episode(""))
        assert got[0] == (want["a", v], [v] * (len(prompt) + N), "a")
        assert got[1] == (want["b", v], [v] * (len(prompt) + N), "b")
        assert got[2] == (base, [0] * (len(prompt) + N), "")
    assert engine.counters.extra.get("batched_rows", 0) > batched_before  # rows of different adapters shared forwards

    seq = prompt + want["a", 2]
    scored = np.asarray((await client.score_tokens(seq, len(prompt), adapter="a")).logprobs)
    with torch.inference_mode():
        logits = models["a", 2](input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(want["a", 2])[:, None])[:, 0].numpy()
    assert np.max(np.abs(scored - ref)) < 1e-4

    with pytest.raises(FailedPreconditionError, match="version 2 keeps serving"):
        await client.update_weights(str(dirs["b", 1]), adapter="a", proof=weight_proof(models["a", 2]))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(json.loads((dirs["a", 1] / "adapter_config.json").read_text())))
    tensors = load_file(str(dirs["a", 1] / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = tensors[key][:-1]
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(InvalidArgumentError, match="q_proj has A"):
        await client.update_weights(str(bad), adapter="a")
    assert dict((await client.server_info()).models[0].adapters) == {"a": 2, "b": 2}
    assert (await episode("a"))[0] == want["a", 2]
    assert engine.loaded_adapters == {"a@v2", "b@v2"}  # the versions before were unloaded


async def test_sglang_lora_routes_through_the_standin_and_trtllm_says_unimplemented(tmp_path: Path) -> None:
    """SGLang's LoRA wire format (``/load_lora_adapter``, ``lora_path`` on ``/generate``) against the stand-in, backed
    by the embedded engine: the episode's tokens equal peft's; a proof is refused (SGLang cannot score one here);
    TensorRT-LLM's adapter serves no adapters."""
    from core.types import AdapterRef
    from engines import make_engines
    from engines.config import EmbeddedConfig, EngineConfig
    from engines.embedded.engine import EmbeddedEngine
    from rl_client import weight_proof
    from rl_client.errors import BridgeError
    from tests.integration.engine_script import bridge_over
    from tests.standins.sglang import SglangStandin
    from tests.standins.trtllm import TrtllmStandin

    model_dir = Path(ensure_converted())
    backing = await EmbeddedEngine.start(EmbeddedConfig(max_model_len=2048), model="smollm2")
    standin = SglangStandin(backing, served_model_name="smollm2", lora=True)
    trt = TrtllmStandin(backing, served_model_name="smollm2")
    servers = [await standin.serve(), await trt.serve()]
    try:
        prompt = backing.tokenizer.encode(STORY)
        dirs = [make_adapter(model_dir, tmp_path / f"s{v}", seed=v) for v in (1, 2)]
        models = [with_adapter(model_dir, d) for d in dirs]
        (engine,) = await make_engines(EngineConfig(type="sglang", urls=[servers[0].url], model="smollm2"))
        async with bridge_over([engine]) as (server, client):
            with pytest.raises(BridgeError) as err:
                await client.update_weights(str(dirs[0]), adapter="s", proof=weight_proof(models[0]))
            assert err.value.code.name == "UNIMPLEMENTED" and "cannot score a probe" in err.value.details
            for v, (d, m) in enumerate(zip(dirs, models, strict=True), start=1):
                assert await client.update_weights(str(d), adapter="s") == v
                started = await client.start_episode(prompt, adapter="s", sampling=GREEDY)
                turn = await client.step(started.episode_id)
                traj = await client.end_episode(started.episode_id)
                assert list(turn.token_ids) == greedy(m, prompt, N) and set(traj.policy_versions.tolist()) == {v}
                assert standin.requests[-1]["lora_path"] == f"s@v{v}"
            for _ in range(50):  # version 1 is unloaded once its last turn ended (in the background)
                if list(standin.loras) == ["s@v2"]:
                    break
                await asyncio.sleep(0.1)
            assert list(standin.loras) == ["s@v2"]
            # The replica restarts (its adapters are gone) and comes back: its health check loads them again.
            await backing.unload_adapter(AdapterRef("s@v2", 0))
            standin.loras.clear()
            server.bridge.mark_replica(0, False, "restarted")
            assert await server.check_health() and list(standin.loras) == ["s@v2"]
            started = await client.start_episode(prompt, adapter="s", sampling=GREEDY)
            assert list((await client.step(started.episode_id)).token_ids) == greedy(models[1], prompt, N)
        (engine,) = await make_engines(EngineConfig(type="trtllm", urls=[servers[1].url], model="smollm2"))
        async with bridge_over([engine]) as (_, client):
            with pytest.raises(BridgeError) as err:
                await client.update_weights(str(dirs[0]), adapter="s")
            assert err.value.code.name == "UNIMPLEMENTED" and "'trtllm' cannot serve LoRA adapters" in err.value.details
    finally:
        for server in servers:
            await server.stop()
        await backing.close()


async def test_openai_sdk_names_the_adapter_as_its_model(start_bridge: object, tmp_path: Path) -> None:
    """The HTTP front door as vLLM users address LoRA: ``POST /update_weights`` with ``adapter``, the adapter listed
    in ``GET /v1/models`` with the base model as parent, and an ``openai`` SDK completion with ``model`` = the
    adapter's name sampling with it (greedy tokens equal peft's)."""
    import httpx
    import openai

    from engines.launch import free_port

    model_dir = Path(ensure_converted())
    server, _ = await start_bridge(engine={"type": "embedded"}, http={"port": free_port()})  # type: ignore[operator]
    base = f"http://127.0.0.1:{server.http_port}"
    adapter = make_adapter(model_dir, tmp_path / "m", seed=11)
    prompt = server.bridge.engines[0].tokenizer.encode(STORY)
    async with httpx.AsyncClient(trust_env=False) as http:
        bad = await http.post(f"{base}/update_weights", json={"weight_dir": str(tmp_path), "adapter": "math"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        ok = await http.post(f"{base}/update_weights", json={"weight_dir": str(adapter), "adapter": "math"})
        assert ok.status_code == 200 and ok.json()["policy_version"] == 1
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0)
    try:
        listed = {m.id: m.model_extra.get("parent") for m in (await sdk.models.list()).data}
        assert listed["math"] == server.bridge.info.model
        out = await sdk.completions.create(
            model="math", prompt=prompt, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
        )
        assert out.choices[0].model_extra["token_ids"] == greedy(with_adapter(model_dir, adapter), prompt, N)
        assert out.model == "math"  # as vLLM answers: the adapter the call named
        chat = await sdk.chat.completions.create(
            model="math", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.model == "math"
        base_out = await sdk.completions.create(model=server.bridge.info.model, prompt=prompt, max_tokens=1)
        assert base_out.model == server.bridge.info.model
    finally:
        await sdk.close()
