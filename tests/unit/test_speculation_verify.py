"""Exactness of speculative verification: the output distribution is the policy's (issue 9, AC2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from core.types import GenerateRequest, Origin, SamplingParams
from engines.config import ToyConfig
from engines.sampling import log_softmax, processed_logprobs, verify
from engines.toy import END, ToyEngine

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_accepts_iff_argmax_and_reports_raw_logprob() -> None:
    rows = [LOGITS, LOGITS[::-1].copy(), LOGITS]
    out = verify(rows, (0, 5), SamplingParams(temperature=0), np.random.default_rng(0))
    assert [(t, o) for t, _, o in out] == [(0, Origin.DRAFT_ACCEPTED), (5, Origin.DRAFT_ACCEPTED), (0, Origin.SAMPLED)]
    out = verify(rows, (0, 4), SamplingParams(temperature=0), np.random.default_rng(0))
    assert [(t, o) for t, _, o in out] == [(0, Origin.DRAFT_ACCEPTED), (5, Origin.RESAMPLED)]
    assert out[1][1] == pytest.approx(log_softmax(rows[1])[5])


def test_token_outside_top_k_is_always_rejected_and_never_resampled() -> None:
    params = SamplingParams(temperature=1.0, top_k=2)
    rng = np.random.default_rng(1)
    for _ in range(200):
        ((token, logprob, origin),) = verify([LOGITS, LOGITS], (4,), params, rng)
        assert origin == Origin.RESAMPLED and token in (0, 1)
        assert logprob == pytest.approx(processed_logprobs(LOGITS, params)[token])


def test_verify_needs_one_row_per_draft_token_plus_one() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        verify([LOGITS], (1,), SamplingParams(), np.random.default_rng(0))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9)])
def test_single_position_matches_processed_distribution(params: SamplingParams) -> None:
    rng = np.random.default_rng(7)
    n = 20_000
    counts = np.zeros(LOGITS.shape[0])
    for i in range(n):
        (token, _, _), *_ = verify([LOGITS, LOGITS], (i % 3,), params, rng)
        counts[token] += 1
    expected = np.exp(processed_logprobs(LOGITS, params)) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], expected[support]).pvalue > 0.01


class MixedDrafter:
    """Deterministic drafts that are sometimes likely (the argmax) and sometimes not."""

    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        self.drafted = self.accepted = 0

    def draft(self, history: Sequence[int], max_len: int) -> tuple[int, ...]:
        out: list[int] = []
        h = list(history)
        for i in range(min(3, max_len)):
            tok = int(np.argmax(self.engine.logits(h))) if i < 2 else (len(h) * 7 + 11) % 40 + 8
            out.append(tok)
            h.append(tok)
        return tuple(out)

    def feedback(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted


async def _collect(
    engine: ToyEngine, n: int, params: SamplingParams, drafter: MixedDrafter | None, seed0: int
) -> np.ndarray:
    """``n`` continuations of 3 tokens each, as an (n, 3) array (request i is seeded ``seed0 + i``)."""
    out = np.zeros((n, 3), dtype=np.int64)
    for i in range(n):
        req = GenerateRequest(f"r{i}", (1, 40, 41), replace(params, seed=seed0 + i), drafter=drafter)
        ids: list[int] = []
        origins: list[Origin] = []
        async for chunk in engine.generate(req):
            ids.extend(chunk.token_ids)
            origins.extend(chunk.origins_or_sampled())
        assert len(ids) == 3
        out[i] = ids
    return out


def _exact_marginals(engine: ToyEngine, params: SamplingParams, prompt: list[int]) -> list[np.ndarray]:
    """Exact distribution of each of the 3 generated tokens (sum over the toy model's paths)."""
    v = engine.config.vocab_size
    p1 = np.exp(processed_logprobs(engine.logits(prompt), params))
    p2 = np.zeros(v)
    p3 = np.zeros(v)
    for a in map(int, np.nonzero(p1)[0]):
        pa = np.exp(processed_logprobs(engine.logits([*prompt, a]), params))
        p2 += p1[a] * pa
        for b in map(int, np.nonzero(pa > 1e-12)[0]):
            p3 += p1[a] * pa[b] * np.exp(processed_logprobs(engine.logits([*prompt, a, b]), params))
    return [p1, p2, p3]


def _chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> float:
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a thin tail into the last real bin
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
async def test_toy_engine_distribution_with_speculation_matches_without(temperature: float) -> None:
    """AC2: 20,000 continuations with and without speculation; each position's marginal matches the
    exact one (goodness of fit) and the two samples match each other (contingency test)."""
    engine = ToyEngine(ToyConfig(vocab_size=64, seed=3))
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    n = 20_000
    drafter = MixedDrafter(engine)
    # Fixed, disjoint seeds: the test is deterministic and the two samples are independent.
    spec = await _collect(engine, n, params, drafter, seed0=0)
    plain = await _collect(engine, n, params, None, seed0=10 * n)
    assert drafter.drafted > n and 0.2 < drafter.accepted / drafter.drafted < 0.9  # both paths exercised
    v = engine.config.vocab_size
    for pos, exact in enumerate(_exact_marginals(engine, params, [1, 40, 41])):
        for sample in (spec, plain):
            counts = np.bincount(sample[:, pos], minlength=v).astype(float)
            assert _chi2(counts, exact, n) > 0.01, (temperature, pos)
        table = np.stack([np.bincount(s[:, pos], minlength=v) for s in (spec, plain)])
        table = table[:, table.sum(axis=0) >= 10]
        assert stats.chi2_contingency(table).pvalue > 0.01
    # Joint of the first two tokens too (the dependence between positions is preserved).
    pair = lambda s: s[:, 0] * v + s[:, 1]  # noqa: E731
    table = np.stack([np.bincount(pair(s), minlength=v * v) for s in (spec, plain)])
    table = table[:, table.sum(axis=0) >= 10]
    assert stats.chi2_contingency(table).pvalue > 0.01
    assert END not in (1, 40, 41)


async def test_toy_engine_reports_origins_and_saves_forwards() -> None:
    engine = ToyEngine(ToyConfig(vocab_size=64, seed=3))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    class Oracle:
        def draft(self, history: Sequence[int], max_len: int) -> tuple[int, ...]:
            h, out = list(history), []
            for _ in range(min(4, max_len)):
                out.append(int(np.argmax(engine.logits(h))))
                h.append(out[-1])
            return tuple(out)

        def feedback(self, drafted: int, accepted: int) -> None:
            assert drafted == accepted

    async def run(drafter: Oracle | None) -> tuple[list[int], list[Origin], int]:
        before = engine.counters.forward_passes
        ids: list[int] = []
        origins: list[Origin] = []
        async for chunk in engine.generate(GenerateRequest("g", (1, 40), params, drafter=drafter)):
            ids.extend(chunk.token_ids)
            origins.extend(chunk.origins_or_sampled())
        return ids, origins, engine.counters.forward_passes - before

    plain_ids, plain_origins, plain_fw = await run(None)
    spec_ids, spec_origins, spec_fw = await run(Oracle())
    assert spec_ids == plain_ids and len(spec_ids) == 30
    assert set(plain_origins) == {Origin.SAMPLED}
    assert spec_origins.count(Origin.DRAFT_ACCEPTED) == 24 and plain_fw == 30 and spec_fw == 6
