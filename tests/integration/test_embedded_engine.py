"""The embedded SmolLM2 engine behind a real gRPC bridge: exactness, stateful decode, groups, seeds, weights.

The reference for every exactness check is an independently loaded ``transformers`` model (greedy
``generate`` and full-sequence forward passes) on the same converted checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from scipy import stats

from rl_client import AsyncBridgeClient
from rl_client.errors import FailedPreconditionError, InvalidArgumentError
from server.app import BridgeServer, create_server
from server.config import load_settings

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

Bridge = tuple[BridgeServer, AsyncBridgeClient]

PROMPTS = [
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain what a prime number is.",
]
MAX_MODEL_LEN = 1024


async def _start(**overrides: Any) -> Bridge:
    engine = {"type": "embedded", "embedded": {"max_model_len": MAX_MODEL_LEN}} | overrides.pop("engine", {})
    server = await create_server(
        load_settings(engine=engine, server={"port": 0, "grace_period_s": 1.0}, metrics={"port": 0}, **overrides)
    )
    await server.start()
    return server, AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=120)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def embedded() -> AsyncIterator[Bridge]:
    server, client = await _start()
    yield server, client
    await client.close()
    await server.stop(0.5)


@pytest.fixture(scope="module")
def reference() -> Any:
    """An independent transformers model on the same checkpoint."""
    from engines.model_store import ensure_converted, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ensure_converted())
    return model


def _engine(server: BridgeServer) -> Any:
    return server.bridge.engines[0]


def _chat(server: BridgeServer, text: str) -> list[int]:
    from core.types import Message

    return _engine(server).tokenizer.render_prompt([Message("user", text)])


def _generated_logprobs(model: Any, prompt: list[int], ids: list[int], temperature: float = 1.0) -> Any:
    """The reference's logprob of each generated token ``ids`` after ``prompt`` at ``temperature`` (numpy)."""
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(ids))
    return (_full_logprobs(model, prompt + ids, temperature)[rows, torch.tensor(ids)]).numpy()


def _full_logprobs(model: Any, ids: list[int], temperature: float = 1.0) -> Any:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / temperature, dim=-1)


async def test_greedy_equals_transformers_generate_and_logprobs_match_full_forward(
    embedded: Bridge, reference: Any
) -> None:
    server, client = embedded
    for text in PROMPTS:
        prompt = _chat(server, text)
        started = await client.start_episode(prompt, sampling={"temperature": 0, "max_tokens": 64, "ignore_eos": True})
        turn = await client.step(started.episode_id)
        await client.discard_episode(started.episode_id)
        with torch.inference_mode():  # an explicit mask: SmolLM2's pad id is its EOS, which generate would mask
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=64,
                eos_token_id=None,
            )
        assert turn.token_ids.tolist() == expected[0, len(prompt) :].tolist(), text
        logp = _full_logprobs(reference, prompt + turn.token_ids.tolist())
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + 64)
        want = logp[positions, torch.tensor(turn.token_ids.tolist())].numpy()
        np.testing.assert_allclose(turn.logprobs, want, atol=1e-4, rtol=0)


async def test_raw_logprobs_are_the_temperature_one_distribution(embedded: Bridge, reference: Any) -> None:
    server, client = embedded
    prompt = _chat(server, "Name a fruit.")
    sampling = {"temperature": 0.7, "max_tokens": 12, "seed": 2, "raw_logprobs": True}
    ep = (await client.start_episode(prompt, sampling=sampling)).episode_id
    turn = await client.step(ep)
    traj = await client.end_episode(ep)
    raw = _generated_logprobs(reference, prompt, turn.token_ids.tolist())
    tempered = _generated_logprobs(reference, prompt, turn.token_ids.tolist(), temperature=0.7)
    assert turn.raw_logprobs is not None
    np.testing.assert_allclose(turn.raw_logprobs, raw, atol=1e-4, rtol=0)
    np.testing.assert_allclose(turn.logprobs, tempered, atol=1e-4, rtol=0)
    assert traj.raw_logprobs is not None
    assert np.isnan(traj.raw_logprobs[: len(prompt)]).all()
    np.testing.assert_array_equal(traj.raw_logprobs[len(prompt) :], turn.raw_logprobs)


async def test_five_turns_prefill_only_new_tokens_and_eviction_recomputes_identically(embedded: Bridge) -> None:
    server, client = embedded
    engine = _engine(server)
    prompt = _chat(server, "Let's count animals. Name one.")
    sampling = {"temperature": 0.8, "max_tokens": 12, "seed": 11}
    a = (await client.start_episode(prompt, sampling=sampling)).episode_id
    b = (await client.start_episode(prompt, sampling=sampling)).episode_id
    turns: dict[str, list[list[int]]] = {a: [], b: []}
    history = {a: len(prompt), b: len(prompt)}
    for t in range(5):
        obs = [{"role": "user", "content": f"Good. Another one, number {t + 2}?"}] if t else None
        for ep in (a, b):
            evicted = ep == b and t == 4
            if evicted:
                assert engine.evict(b)  # the last turn of b recomputes its whole history
            before = engine.counters.prefill_tokens
            turn = await client.step(ep, obs)
            turns[ep].append(turn.token_ids.tolist())
            prefilled = engine.counters.prefill_tokens - before
            if t == 0:
                assert prefilled == len(prompt) == turn.usage.prompt_tokens
            elif evicted:
                assert turn.usage.cached_tokens == 0 and prefilled == turn.usage.prompt_tokens
            else:  # the observation only; last turn's sampled token enters the KV as decode work
                observation = turn.usage.prompt_tokens - history[ep]
                assert observation > 0 and prefilled == observation
                assert turn.usage.cached_tokens == history[ep] - 1
            history[ep] = turn.usage.prompt_tokens + len(turn.token_ids)
    assert turns[a] == turns[b]
    ta = await client.end_episode(a)
    await client.discard_episode(b)
    obs_tokens = [t.generation_start - t.observation_start for t in ta.turns]
    assert obs_tokens[0] == 0 and all(n > 0 for n in obs_tokens[1:])


async def test_kv_of_a_diverging_history_is_cropped_not_reused(embedded: Bridge, reference: Any) -> None:
    """An engine request whose ids diverge from the episode's cached ids reuses only the common prefix."""
    from core.types import GenerateRequest, SamplingParams

    server, _ = embedded
    engine = _engine(server)
    prompt = _chat(server, "Tell me about the sea.")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for chunk in engine.generate(GenerateRequest("r", tuple(ids), greedy, "diverge", "", "s@0")):
            out.extend(chunk.token_ids)
        return out

    first = await run(prompt)
    other = [*prompt[:-3], *engine.tokenizer.encode(" mountains")]  # shares all but the tail with the cache
    before = engine.counters.cached_tokens
    got = await run(other)
    assert engine.counters.cached_tokens - before == len(prompt) - 3
    with torch.inference_mode():
        want = reference.generate(
            torch.tensor([other]),
            attention_mask=torch.ones(1, len(other), dtype=torch.long),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=None,
        )[0, len(other) :].tolist()
    assert got == want and first != got
    await engine.release("diverge")


async def test_grpo_group_of_eight_prefills_the_prompt_once(embedded: Bridge) -> None:
    server, client = embedded
    engine = _engine(server)
    prompt = _chat(server, "Give me a random number between 1 and 100.")
    before = engine.counters.prefill_tokens
    started = await client.start_episode(prompt, group_size=8, sampling={"temperature": 1.0, "max_tokens": 8})
    turns = await asyncio.gather(*(client.step(ep) for ep in started.episode_ids))
    assert engine.counters.prefill_tokens - before == len(prompt)
    assert sorted(t.usage.cached_tokens for t in turns) == [0] + [len(prompt)] * 7
    assert len({tuple(t.token_ids.tolist()) for t in turns}) > 1  # members sample independently
    for ep in started.episode_ids:
        await client.discard_episode(ep)


async def test_seeded_sampling_is_reproducible_and_distributed_as_the_model(embedded: Bridge, reference: Any) -> None:
    server, client = embedded
    prompt = _chat(server, "Say one word.")

    async def sample(seed: int, n: int = 24) -> list[int]:
        ep = (
            await client.start_episode(prompt, sampling={"seed": seed, "max_tokens": n, "ignore_eos": True})
        ).episode_id
        turn = await client.step(ep)
        await client.discard_episode(ep)
        return turn.token_ids.tolist()

    first, again, other = await sample(5), await sample(5), await sample(6)
    assert first == again
    assert first != other

    # 2,000 first tokens (8 groups of 250, seeds seed+i) against the model's softmax.
    counts: dict[int, int] = {}
    for g in range(8):
        started = await client.start_episode(
            prompt, group_size=250, sampling={"seed": 1000 + 250 * g, "max_tokens": 1, "temperature": 1.0}
        )
        turns = await asyncio.gather(*(client.step(ep) for ep in started.episode_ids))
        for ep, turn in zip(started.episode_ids, turns, strict=True):
            counts[int(turn.token_ids[0])] = counts.get(int(turn.token_ids[0]), 0) + 1
            await client.discard_episode(ep)
    probs = _full_logprobs(reference, prompt)[-1].exp().numpy()
    n = sum(counts.values())
    assert n == 2000
    big = [t for t in np.argsort(-probs) if probs[t] * n >= 5]
    observed = [counts.get(int(t), 0) for t in big] + [n - sum(counts.get(int(t), 0) for t in big)]
    expected = [probs[t] * n for t in big] + [n * (1 - probs[big].sum())]
    keep = [i for i, e in enumerate(expected) if e > 0]
    _, p = stats.chisquare([observed[i] for i in keep], [expected[i] * n / sum(expected) for i in keep])
    assert p > 0.01, (p, len(big))


async def test_min_p_samples_the_filtered_distribution_exactly(embedded: Bridge, reference: Any) -> None:
    """600 seeded first tokens under min_p = 0.05 at temperature 0.8: only tokens with p >= 0.05 * p_max (after
    temperature) appear, each with the logprob of the renormalised distribution, at its frequencies."""
    server, client = embedded
    prompt = _chat(server, "Say one word.")
    with torch.inference_mode():
        tempered = torch.softmax(reference(torch.tensor([prompt])).logits[0, -1].double() / 0.8, -1).numpy()
    keep = tempered >= 0.05 * tempered.max()
    probs = np.where(keep, tempered, 0.0) / tempered[keep].sum()
    assert 1 < keep.sum() < 100
    counts: dict[int, int] = {}
    for g in range(3):
        sampling = {"seed": 77 + 200 * g, "max_tokens": 1, "temperature": 0.8, "min_p": 0.05}
        started = await client.start_episode(prompt, group_size=200, sampling=sampling)
        turns = await asyncio.gather(*(client.step(ep) for ep in started.episode_ids))
        for ep, turn in zip(started.episode_ids, turns, strict=True):
            token = int(turn.token_ids[0])
            assert keep[token], token
            assert turn.logprobs[0] == pytest.approx(np.log(probs[token]), abs=1e-4)
            counts[token] = counts.get(token, 0) + 1
            await client.discard_episode(ep)
    n = sum(counts.values())
    big = [t for t in np.argsort(-probs) if probs[t] * n >= 5]
    observed = [counts.get(int(t), 0) for t in big] + [n - sum(counts.get(int(t), 0) for t in big)]
    expected = [probs[t] * n for t in big] + [n * (1 - probs[big].sum())]
    keep_bins = [i for i, e in enumerate(expected) if e > 0]
    _, p = stats.chisquare([observed[i] for i in keep_bins], [expected[i] * n / sum(expected) for i in keep_bins])
    assert p > 0.01, (p, len(big))


async def test_concurrent_episodes_decode_in_batches_with_solo_results(embedded: Bridge) -> None:
    server, client = embedded
    engine = _engine(server)
    prompt = _chat(server, "Tell me a short story.")
    sampling = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    solo = []
    for seed in range(4):
        ep = (await client.start_episode(prompt, sampling=sampling | {"seed": seed})).episode_id
        solo.append((await client.step(ep)).token_ids.tolist())
        await client.discard_episode(ep)
    rows = engine.counters.extra.get("batched_rows", 0)
    eps = [(await client.start_episode(prompt, sampling=sampling | {"seed": s})).episode_id for s in range(4)]
    together = await asyncio.gather(*(client.step(ep) for ep in eps))
    assert engine.counters.extra["batched_rows"] > rows
    assert [t.token_ids.tolist() for t in together] == solo
    for ep in eps:
        await client.discard_episode(ep)


async def test_cancelled_step_stops_at_the_next_token(embedded: Bridge) -> None:
    server, client = embedded
    engine = _engine(server)
    # ignore_eos: sampled at temperature 1 without a seed, the model could end its turn (STOP) before the cancel.
    sampling = {"max_tokens": 400, "ignore_eos": True}
    ep = (await client.start_episode(_chat(server, "Count to one hundred."), sampling=sampling)).episode_id
    got = 0
    async for chunk in client.stream_step(ep):
        got += len(chunk.token_ids)
        if got >= 3:
            break
    await asyncio.sleep(0.5)
    generated = engine.counters.generated_tokens
    await asyncio.sleep(0.5)
    assert engine.counters.generated_tokens == generated  # no work after the cancel
    traj = await client.end_episode(ep)
    assert traj.turns[0].finish_reason == "abort"
    assert 3 <= traj.turns[0].end - traj.turns[0].generation_start < 400


async def test_chat_continuation_is_append_only_and_matches_the_template(embedded: Bridge) -> None:
    server, client = embedded
    tok = _engine(server).tokenizer
    started = await client.start_episode([{"role": "user", "content": "Hi! Who are you?"}], sampling={"max_tokens": 16})
    first = await client.step(started.episode_id)
    second = await client.step(started.episode_id, [{"role": "user", "content": "Nice. Bye."}])
    traj = await client.end_episode(started.episode_id)
    ids = traj.token_ids.tolist()
    assert ids[: len(first.token_ids) + traj.prompt_length][traj.prompt_length :] == first.token_ids.tolist()
    text = tok.decode(ids)
    assert "<|im_start|>user\nNice. Bye.<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.count("<|im_start|>assistant\n") == 2
    assert second.turn_index == 1


async def test_bad_input_names_the_limit(embedded: Bridge) -> None:
    server, client = embedded
    vocab = _engine(server).info.vocab_size
    with pytest.raises(InvalidArgumentError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        await client.start_episode([1, 2, vocab])
    with pytest.raises(InvalidArgumentError, match=f"context window of {MAX_MODEL_LEN} tokens"):
        await client.start_episode([1] * MAX_MODEL_LEN)
    with pytest.raises(InvalidArgumentError, match=f"context window of {MAX_MODEL_LEN} tokens"):
        await client.start_episode([1, 2, 3], sampling={"max_tokens": MAX_MODEL_LEN})
    ep = (await client.start_episode([1, 2, 3], sampling={"max_tokens": 4})).episode_id
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        await client.step(ep, [5, -1])
    assert (await client.step(ep, [5])).usage.generated_tokens <= 4  # nothing half-written
    await client.discard_episode(ep)


def _perturbed_checkpoint(model: Any, path: Path, scale: float) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    state = {
        k: (v + scale * torch.randn(v.shape, generator=gen) * v.std()).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied to the embeddings
    }
    save_file(state, str(path / "model.safetensors"))


async def test_update_weights_changes_outputs_and_versions(tmp_path: Path, reference: Any) -> None:
    server, client = await _start()
    try:
        engine = _engine(server)
        prompt = _chat(server, "What is 2+2?")
        greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
        ep = (await client.start_episode(prompt, sampling=greedy)).episode_id
        before = await client.step(ep)
        baseline = (await client.start_episode(prompt, sampling=greedy)).episode_id
        _perturbed_checkpoint(reference, tmp_path, 0.5)
        with pytest.raises(InvalidArgumentError, match="is not a directory"):
            await client.update_weights(str(tmp_path / "missing"))
        cut = tmp_path / "cut"  # the checkpoint as read while still being written: refused, version unchanged
        cut.mkdir()
        (cut / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:1_000_000])
        with pytest.raises(InvalidArgumentError, match=r"model\.safetensors is not a complete safetensors file"):
            await client.update_weights(str(cut))
        assert await client.update_weights(str(tmp_path)) == 1
        prefill = engine.counters.prefill_tokens
        after = await client.step(ep, [engine.tokenizer.encode("\n")[0]])
        # KV of version 0 was dropped: the whole history is prefilled again under version 1.
        assert engine.counters.prefill_tokens - prefill == after.usage.prompt_tokens
        assert after.policy_version == 1 and before.policy_version == 0
        fresh = await client.step(baseline)
        assert fresh.token_ids.tolist() != before.token_ids.tolist()
        traj = await client.end_episode(ep)
        versions = traj.policy_versions
        assert set(versions[traj.turns[0].generation_start : traj.turns[0].end].tolist()) == {0}
        assert set(versions[traj.turns[1].generation_start : traj.turns[1].end].tolist()) == {1}
    finally:
        await client.close()
        await server.stop(0.5)


async def test_a_caller_proof_commits_the_weights_it_proves_and_rolls_back_others(
    tmp_path: Path, reference: Any
) -> None:
    """Issue 36, acceptance 1 on the embedded engine: the trainer sends the logprobs its own copy of the new weights
    gives the probe (``rl_client.weight_proof``); weights that load but differ from them are rolled back (the
    previous checkpoint is served again, under its version) and the call fails naming the replica."""
    import copy

    from safetensors.torch import load_file

    from rl_client import weight_proof

    server, client = await _start()
    try:
        prompt = _chat(server, "Name a color.")
        greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        _perturbed_checkpoint(reference, tmp_path / "a", 0.2)
        _perturbed_checkpoint(reference, tmp_path / "b", 0.4)
        trained = copy.deepcopy(reference)  # the trainer's copy of checkpoint a
        trained.load_state_dict(load_file(str(tmp_path / "a" / "model.safetensors")), strict=False)
        proof = weight_proof(trained)
        assert await client.update_weights(str(tmp_path / "a"), proof=proof) == 1
        served = await client.step((await client.start_episode(prompt, sampling=greedy)).episode_id)
        with pytest.raises(FailedPreconditionError, match=r"replica 'embedded-0' loaded the weights of version 2 but"):
            await client.update_weights(str(tmp_path / "b"), proof=proof)  # b loads, but it is not what a proves
        again = await client.step((await client.start_episode(prompt, sampling=greedy)).episode_id)
        assert again.policy_version == 1 and again.token_ids.tolist() == served.token_ids.tolist()  # a, once more
        assert (await client.server_info()).models[0].policy_version == 1
    finally:
        await client.close()
        await server.stop(0.5)


async def test_kept_mass_recovers_the_untruncated_logprob(embedded: Bridge, reference: Any) -> None:
    """top-k 20 at temperature 0.7: logprob + kept_logmass is the untruncated tempered logprob of the reference."""
    server, client = embedded
    prompt = _chat(server, "Name a fruit.")
    sampling = {"temperature": 0.7, "top_k": 20, "max_tokens": 12, "seed": 2, "kept_mass": True, "ignore_eos": True}
    ep = (await client.start_episode(prompt, sampling=sampling)).episode_id
    turn = await client.step(ep)
    traj = await client.end_episode(ep)
    tempered = _generated_logprobs(reference, prompt, turn.token_ids.tolist(), temperature=0.7)
    assert turn.kept_logmass is not None and (turn.kept_logmass < 0).all()  # top-k 20 of 49,152 always cuts
    np.testing.assert_allclose(turn.logprobs + turn.kept_logmass, tempered, atol=1e-4, rtol=0)
    assert traj.kept_logmass is not None and np.isnan(traj.kept_logmass[: len(prompt)]).all()
    np.testing.assert_array_equal(traj.kept_logmass[len(prompt) :], turn.kept_logmass)
