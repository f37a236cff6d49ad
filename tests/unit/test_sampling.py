"""Exactness of sampling: reported logprobs are those of the distribution sampled from."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from core.types import SamplingParams
from engines.config import ToyConfig
from engines.sampling import log_softmax, processed_logprobs, sample
from engines.toy import ToyEngine, ToyTokenizer

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_topk_topp_masks() -> None:
    p = np.exp(processed_logprobs(LOGITS, SamplingParams(temperature=0.5, top_k=3)))
    assert np.count_nonzero(p) == 3 and p.sum() == pytest.approx(1.0)
    ref = np.exp(LOGITS[:3] / 0.5) / np.exp(LOGITS[:3] / 0.5).sum()
    np.testing.assert_allclose(p[:3], ref)
    raw = np.exp(log_softmax(LOGITS))
    p = np.exp(processed_logprobs(LOGITS, SamplingParams(top_p=0.8)))
    keep = int(np.searchsorted(np.cumsum(raw), 0.8)) + 1
    assert np.count_nonzero(p) == keep
    np.testing.assert_allclose(p[:keep], raw[:keep] / raw[:keep].sum())


def test_greedy_reports_raw_logprob() -> None:
    token, logprob = sample(LOGITS, SamplingParams(temperature=0), np.random.default_rng(0))
    assert token == 0 and logprob == pytest.approx(log_softmax(LOGITS)[0])


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4, top_p=0.9)]
)
def test_empirical_distribution_matches_reported_logprobs(params: SamplingParams) -> None:
    rng = np.random.default_rng(123)
    n = 20_000
    counts = np.zeros(LOGITS.shape[0])
    for _ in range(n):
        token, _ = sample(LOGITS, params, rng)
        counts[token] += 1
    expected = np.exp(processed_logprobs(LOGITS, params)) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], expected[support]).pvalue > 0.01


def test_toy_engine_logits_depend_on_context_and_seed() -> None:
    a, b = ToyEngine(ToyConfig(seed=0)), ToyEngine(ToyConfig(seed=1))
    assert not np.allclose(a.logits([10, 11]), a.logits([10, 12]))
    assert not np.allclose(a.logits([10, 11]), a.logits([9, 11]))  # trigram context matters
    assert not np.allclose(a.logits([10, 11]), b.logits([10, 11]))


def test_toy_tokenizer_round_trip() -> None:
    tok = ToyTokenizer(512)
    text = "what is the answer"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.vocab) == 512


async def test_toy_plain_sampling_equals_the_general_path_before_and_after_a_weight_update() -> None:
    """The toy's fast path (exp tables) draws the same tokens with the same logprobs as ``sample(logits)``."""
    from core.types import WeightUpdate

    engine = ToyEngine(ToyConfig())
    params = SamplingParams(temperature=1.0)
    histories = [[], [1], *([1, 4, int(t), int(u)] for t, u in np.random.default_rng(3).integers(8, 512, (300, 2)))]
    for version in (0, 1):
        if version:
            await engine.update_weights(WeightUpdate(checkpoint_path="", policy_version=1))
        fast, general = np.random.default_rng(7), np.random.default_rng(7)
        for history in histories:
            token, logprob = engine._sample_plain(history, fast)
            want_token, want_logprob = sample(engine.logits(history), params, general)
            assert token == want_token and logprob == pytest.approx(want_logprob, abs=1e-9)


def test_min_p_keeps_tokens_above_a_fraction_of_the_most_likely_after_temperature() -> None:
    params = SamplingParams(temperature=0.8, min_p=0.2)
    p = np.exp(processed_logprobs(LOGITS, params))
    tempered = np.exp(LOGITS / 0.8) / np.exp(LOGITS / 0.8).sum()
    keep = tempered >= 0.2 * tempered.max()
    assert 1 < keep.sum() < len(LOGITS)  # the cut is not trivial for these logits
    np.testing.assert_allclose(p[keep], tempered[keep] / tempered[keep].sum())
    assert (p[~keep] == 0).all()
    # With top-k and top-p, min-p comes first (vLLM's order): the kept set is then cut by the nucleus.
    both = np.exp(processed_logprobs(LOGITS, SamplingParams(temperature=0.8, min_p=0.05, top_p=0.7)))
    assert np.count_nonzero(both) <= np.count_nonzero(np.exp(processed_logprobs(LOGITS, SamplingParams(min_p=0.05))))


def test_min_p_sampling_matches_the_filtered_distribution() -> None:
    params = SamplingParams(temperature=1.3, min_p=0.1)
    rng = np.random.default_rng(9)
    n = 20_000
    counts = np.zeros(LOGITS.shape[0])
    for _ in range(n):
        token, _ = sample(LOGITS, params, rng)
        counts[token] += 1
    expected = np.exp(processed_logprobs(LOGITS, params)) * n
    support = expected > 0
    assert counts[~support].sum() == 0 and support.sum() < len(LOGITS)
    assert stats.chisquare(counts[support], expected[support]).pvalue > 0.01


async def test_toy_engine_samples_min_p_exactly() -> None:
    """First tokens of 3,000 seeded toy turns follow the min-p distribution; each logprob is exact."""
    from core.types import GenerateRequest

    engine = ToyEngine(ToyConfig())
    prompt = (1, 5, 9)
    logits = engine.logits(prompt)
    n = 3000
    counts = np.zeros(logits.shape[0])
    for seed in range(n):
        params = SamplingParams(temperature=1.0, min_p=0.3, max_tokens=1, seed=seed)
        (chunk,) = [c async for c in engine.generate(GenerateRequest(f"r{seed}", prompt, params))]
        token = chunk.token_ids[0]
        counts[token] += 1
        assert chunk.logprobs[0] == pytest.approx(processed_logprobs(logits, params)[token], abs=1e-12)
    expected = np.exp(processed_logprobs(logits, SamplingParams(min_p=0.3))) * n
    support = expected > 0
    assert 1 < support.sum() < 50  # min-p cut most of the toy's 512 tokens
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], expected[support]).pvalue > 0.01


async def test_toy_turns_draw_what_token_by_token_sampling_draws() -> None:
    """A toy turn samples a chunk in one call and may take its uniform draws at once: its tokens and logprobs are
    those of ``_sample_plain`` one token at a time, and a turn that stops mid-chunk leaves the shared generator
    where token-by-token sampling leaves it (the next unseeded turns still match)."""
    from core.types import FinishReason, GenerateRequest
    from engines.toy import END

    config = ToyConfig(yield_every=5)
    engine, reference = ToyEngine(config), ToyEngine(config)
    cases = [
        SamplingParams(max_tokens=23, ignore_eos=True),
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=23, ignore_eos=True, seed=5),
        SamplingParams(max_tokens=40, seed=5, stop_token_ids=(12,)),
        SamplingParams(max_tokens=40, raw_logprobs=True),
        SamplingParams(max_tokens=40, stop_token_ids=tuple(range(8, 512, 3))),  # stops within a few tokens
    ]
    stopped = 0
    for prompt in ([1, 4, 30], [1], [1, 5, 9, 2, 7]):
        for params in cases:
            chunks = [c async for c in engine.generate(GenerateRequest("r", tuple(prompt), params))]
            rng = np.random.default_rng(params.seed) if params.seed is not None else reference._rng
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {END})
            history, want = list(prompt), list[tuple[int, float]]()
            while len(want) < params.max_tokens and (not want or want[-1][0] not in stops):
                token, logprob = reference._sample_plain(history, rng)
                history.append(token)
                want.append((token, logprob))
            assert [(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs, strict=True)] == want
            assert all(len(c.token_ids) == 5 for c in chunks[:-1]) and all(not c.origins for c in chunks)
            if params.raw_logprobs:
                assert [x for c in chunks for x in c.raw_logprobs] == [lp for _, lp in want]
            stopped += params.seed is None and chunks[-1].finish_reason == FinishReason.STOP
    assert stopped  # an unseeded turn stopped mid-chunk, and the unseeded turns after it still matched


@pytest.mark.parametrize(
    "cut",
    [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"top_k": 50, "top_p": 0.8, "min_p": 0.01}],
    ids=["top_p", "top_k", "min_p", "all"],
)
def test_processed_logprob_plus_kept_mass_is_the_untruncated_logprob(cut: dict[str, float]) -> None:
    from engines.sampling import kept_logmass

    logits = np.random.default_rng(1).normal(0.0, 3.0, 500)
    params = SamplingParams(temperature=0.7, **cut)  # type: ignore[arg-type]
    processed = processed_logprobs(logits, params)
    kept = kept_logmass(logits, params)
    assert kept < 0.0  # something was cut
    untruncated = log_softmax(logits / 0.7)
    ok = np.isfinite(processed)
    np.testing.assert_allclose(processed[ok] + kept, untruncated[ok], rtol=0, atol=1e-12)
    assert kept == pytest.approx(float(np.log(np.exp(untruncated[ok]).sum())), abs=1e-12)


def test_kept_mass_is_zero_when_nothing_is_cut_and_counts_a_grammar_mask() -> None:
    from engines.sampling import kept_logmass

    logits = np.random.default_rng(2).normal(0.0, 2.0, 100)
    assert kept_logmass(logits, SamplingParams(temperature=0.7)) == 0.0
    assert kept_logmass(logits, SamplingParams(temperature=0.0, top_k=5)) == 0.0  # greedy reports the raw distribution
    masked = np.where(np.arange(100) < 10, logits, -np.inf)  # a grammar allows tokens 0..9
    want = float(np.log(np.exp(log_softmax(logits / 0.7)[:10]).sum()))
    assert kept_logmass(logits, SamplingParams(temperature=0.7), masked) == pytest.approx(want, abs=1e-12)
