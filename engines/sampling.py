"""Exact sampling from a logit vector (numpy), shared by the CPU engines.

``processed_logprobs`` returns the log-probabilities of the distribution that is actually
sampled from, after temperature, min-p, top-k and top-p (vLLM's order), so the logprob reported for a sampled
token is exact (the invariant trainers rely on for importance ratios).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from core.types import Origin, SamplingParams

FloatArray = npt.NDArray[np.float64]


def log_softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def unfiltered(params: SamplingParams) -> bool:
    """True when no filter (min-p, top-k, top-p) removes any token: plain temperature sampling."""
    return params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0


def processed_logprobs(logits: FloatArray, params: SamplingParams) -> FloatArray:
    """Log-probabilities after temperature, min-p, top-k and top-p (``-inf`` for excluded tokens).

    Greedy (temperature 0) returns the raw distribution; the caller takes the argmax. Min-p keeps the
    tokens with ``p >= min_p * p_max`` under the temperature-scaled distribution.
    """
    if params.temperature == 0:
        return log_softmax(logits)
    scaled = logits / params.temperature
    if params.min_p > 0:
        # p / p_max = exp(scaled - max): compare in log space, no normalisation needed.
        scaled = np.where(scaled - np.max(scaled) >= np.log(params.min_p), scaled, -np.inf)
    if 0 < params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    logp = log_softmax(scaled)
    if params.top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        probs = np.exp(logp[order])
        cum = np.cumsum(probs)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        mask = np.full(logp.shape, -np.inf)
        mask[order[:keep]] = 0.0
        logp = log_softmax(logp + mask)
    return logp


def kept_logmass(logits: FloatArray, params: SamplingParams, sampled_from: FloatArray | None = None) -> float:
    """Log of the probability mass, under the temperature-scaled distribution of ``logits``, of the tokens the
    sampler could draw: those its filters (min-p, top-k, top-p) kept from ``sampled_from`` (``logits`` with a
    grammar mask's ``-inf``; default ``logits``). 0.0 when nothing was cut. ``processed logprob + this`` is the
    token's logprob under the untruncated temperature-scaled distribution (``sampling.kept_mass``)."""
    masked = sampled_from is not None and bool(np.any(np.isneginf(sampled_from) & np.isfinite(logits)))
    if params.temperature == 0 or (unfiltered(params) and not masked):
        return 0.0
    kept = np.isfinite(processed_logprobs(logits if sampled_from is None else sampled_from, params))
    scaled = log_softmax(logits / params.temperature)[kept]
    top = float(np.max(scaled))
    return min(0.0, top + float(np.log(np.sum(np.exp(scaled - top)))))


def raw_logprob(logits: FloatArray, token: int) -> float:
    """Logprob of ``token`` under the raw model distribution (temperature 1, no filtering)."""
    return float(log_softmax(logits)[token])


def sample(logits: FloatArray, params: SamplingParams, rng: np.random.Generator) -> tuple[int, float]:
    """Sample one token; return it with its logprob under the sampling distribution."""
    if params.temperature > 0 and unfiltered(params):
        # Fast path (plain temperature sampling): one exp and one cumsum, same draws and
        # same distribution as the general path below.
        shifted = logits / params.temperature if params.temperature != 1.0 else logits
        weights = np.exp(shifted - shifted.max())
        cdf = np.cumsum(weights)
        token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.shape[0] - 1)
        while weights[token] == 0.0:
            token -= 1
        return token, float(np.log(weights[token] / cdf[-1]))
    logp = processed_logprobs(logits, params)
    if params.temperature == 0:
        token = int(np.argmax(logp))
    else:
        # Inverse-CDF sampling: one uniform draw per token, reproducible for a given seed.
        cdf = np.cumsum(np.exp(logp))
        token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        token = min(token, cdf.shape[0] - 1)
        while logp[token] == -np.inf:  # a zero-width bucket can only be hit at its edge
            token -= 1
    return token, float(logp[token])


def _greedy(logits: FloatArray) -> tuple[int, float]:
    logp = log_softmax(logits)
    token = int(np.argmax(logp))
    return token, float(logp[token])


def verify(
    rows: FloatArray | list[FloatArray],
    draft: tuple[int, ...] | list[int],
    params: SamplingParams,
    rng: np.random.Generator,
) -> list[tuple[int, float, Origin]]:
    """Verify a deterministic draft against the target's logits; return the emitted tokens.

    ``rows[i]`` are the next-token logits after the history plus ``draft[:i]``; there are
    ``len(draft) + 1`` of them. The result is the accepted draft prefix (``DRAFT_ACCEPTED``)
    followed by one more token: ``RESAMPLED`` at the first rejection, or, when the whole
    draft is accepted, a bonus token drawn from the last row by ``sample`` (``SAMPLED``).
    Each entry carries log p(token) under the distribution ``sample`` uses for that row.
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"verify needs len(draft) + 1 = {len(draft) + 1} logit rows, got {len(rows)}")
    out: list[tuple[int, float, Origin]] = []
    for i, x in enumerate(draft):
        if params.temperature == 0:
            token, logprob = _greedy(rows[i])
            if token == x:
                out.append((token, logprob, Origin.DRAFT_ACCEPTED))
                continue
            out.append((token, logprob, Origin.RESAMPLED))
            return out
        logp = processed_logprobs(rows[i], params)
        if rng.random() < np.exp(logp[x]):
            out.append((int(x), float(logp[x]), Origin.DRAFT_ACCEPTED))
            continue
        # Rejected: the residual norm(max(0, p - q)) with q = delta_x is p with x removed.
        weights = np.exp(logp)
        weights[x] = 0.0
        cdf = np.cumsum(weights)
        if cdf[-1] <= 0.0:  # p(x) rounds below 1 but no other token has mass: x it is
            out.append((int(x), float(logp[x]), Origin.DRAFT_ACCEPTED))
            continue
        token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.shape[0] - 1)
        while weights[token] == 0.0:  # a zero-width bucket can only be hit at its edge
            token -= 1
        out.append((token, float(logp[token]), Origin.RESAMPLED))
        return out
    token, logprob = sample(rows[len(draft)], params, rng)
    out.append((token, logprob, Origin.SAMPLED))
    return out
