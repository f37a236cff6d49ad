"""The trainer-inference mismatch monitor (issue 38): for the tokens a step trains on, how far the trainer's
logprobs are from the ones the engine sampled them with.

Per token, ``d = trainer logprob - engine logprob`` and the ratio ``r = exp(d)`` (trainer over engine). Over the
tokens sampled by the policy the trainer holds (lag 0: same weights on both sides), the figures are the mismatch
itself:

* ``mismatch/k3_kl``: the token mean of ``r - 1 - log r``, an unbiased estimate of KL(engine || trainer) for tokens
  sampled from the engine (Schulman's k3);
* ``mismatch/abs_mean`` and ``mismatch/abs_max``: mean and largest ``|d|``;
* ``mismatch/out_0.9_1.1`` and ``mismatch/out_0.5_2``: the share of tokens whose ratio leaves that band;
* ``mismatch/tokens``: how many tokens they cover.

The same figures per origin (``mismatch/sampled/...``, ``mismatch/draft_accepted/...``) and per policy lag
(``mismatch/lag1/...``: tokens sampled 1 version before the trainer's; there the trainer's weights are newer than
the sampler's, so these measure the policy's drift plus the mismatch, which asynchronous runs show). A run with no
lag-0 tokens reports the top-level figures as NaN (nothing on-policy to compare).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from grpo.masks import ORIGIN_NAMES

BANDS: tuple[tuple[float, float], ...] = ((0.9, 1.1), (0.5, 2.0))
FIGURES = ("k3_kl", "abs_mean", "abs_max", "out_0.9_1.1", "out_0.5_2", "tokens")


class _Sums:
    __slots__ = ("abs_max", "abs_sum", "k3_sum", "n", "out")

    def __init__(self) -> None:
        self.n = 0
        self.k3_sum = 0.0
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.out = [0] * len(BANDS)

    def add(self, d: npt.NDArray[np.float64]) -> None:
        if not d.size:
            return
        r = np.exp(d)
        self.n += int(d.size)
        self.k3_sum += float(np.sum(r - 1.0 - d))
        self.abs_sum += float(np.sum(np.abs(d)))
        self.abs_max = max(self.abs_max, float(np.max(np.abs(d))))
        for i, (lo, hi) in enumerate(BANDS):
            self.out[i] += int(np.count_nonzero((r < lo) | (r > hi)))

    def figures(self) -> dict[str, float]:
        if not self.n:
            return {name: (0.0 if name == "tokens" else math.nan) for name in FIGURES}
        return {
            "k3_kl": self.k3_sum / self.n,
            "abs_mean": self.abs_sum / self.n,
            "abs_max": self.abs_max,
            "out_0.9_1.1": self.out[0] / self.n,
            "out_0.5_2": self.out[1] / self.n,
            "tokens": float(self.n),
        }


class MismatchMonitor:
    """Accumulates one step's tokens (``add`` per trajectory), then ``figures()``."""

    def __init__(self) -> None:
        self.on_policy = _Sums()
        self.by_origin: dict[str, _Sums] = defaultdict(_Sums)
        self.by_lag: dict[int, _Sums] = defaultdict(_Sums)

    def add(
        self,
        trainer_lp: Iterable[float],
        engine_lp: Iterable[float],
        origins: Iterable[int],
        versions: Iterable[int],
        trainer_version: int,
    ) -> None:
        """One trajectory's trained tokens (already masked): the two logprobs, origin and sampling version each."""
        d = np.asarray(list(trainer_lp), np.float64) - np.asarray(list(engine_lp), np.float64)
        o = np.asarray(list(origins), np.int64)
        lag = trainer_version - np.asarray(list(versions), np.int64)
        keep = np.isfinite(d)
        d, o, lag = d[keep], o[keep], lag[keep]
        on = lag == 0
        self.on_policy.add(d[on])
        for code in np.unique(o[on]):
            name = ORIGIN_NAMES[int(code)] if 0 <= int(code) < len(ORIGIN_NAMES) else str(int(code))
            self.by_origin[name].add(d[on & (o == code)])
        for n in np.unique(lag[~on]):
            self.by_lag[int(n)].add(d[lag == n])

    def figures(self) -> dict[str, float]:
        out = {f"mismatch/{k}": v for k, v in self.on_policy.figures().items()}
        for name, sums in sorted(self.by_origin.items()):
            out |= {f"mismatch/{name}/{k}": v for k, v in sums.figures().items()}
        for n, sums in sorted(self.by_lag.items()):
            out |= {f"mismatch/lag{n}/{k}": v for k, v in sums.figures().items()}
        return out


__all__ = ["BANDS", "FIGURES", "MismatchMonitor"]
