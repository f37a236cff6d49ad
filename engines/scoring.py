"""Teacher-forced scoring: the logprob the current weights give each token of a given sequence.

No sampling and no episode state: ``token_ids[i]`` is scored given ``token_ids[:i]`` for every ``i`` in
``[start, len)``, under ``logits / temperature``. An engine that can do it declares ``Capability.SCORE``
and has an ``async score(request) -> ScoreResult``; the bridge refuses the request with UNIMPLEMENTED
(naming the engine) for any other, and for a part of it the engine cannot do (``logits`` from an engine
that only reports logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from core.errors import InvalidArgument, Unimplemented
from core.types import AdapterRef, Capability, EngineInfo, check_token_ids

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

MAX_LOGIT_VALUES = 64 * 1024 * 1024 // 4  # logits returned per request at most (a 64 MiB message)


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    token_ids: tuple[int, ...]
    start: int
    temperature: float = 1.0
    return_logits: bool = False
    adapter: AdapterRef | None = None  # score with this LoRA adapter version (``Capability.LORA``)

    @property
    def scored(self) -> int:
        return len(self.token_ids) - self.start


@dataclass(frozen=True, slots=True)
class ScoreResult:
    logprobs: npt.NDArray[np.float32]  # [scored]
    policy_version: int
    logits: npt.NDArray[np.float32] | None = None  # [scored, vocab] raw logits, when asked


@runtime_checkable
class Scorer(Protocol):
    """An engine that declares ``Capability.SCORE``."""

    async def score(self, request: ScoreRequest) -> ScoreResult: ...


def validate(request: ScoreRequest, info: EngineInfo) -> None:
    """Raise InvalidArgument naming the first bad field, Unimplemented when ``info``'s engine cannot score."""
    n = len(request.token_ids)
    if n < 2:
        raise InvalidArgument(f"token_ids needs a context and at least one token to score, got {n} token(s)")
    check_token_ids(request.token_ids, info.vocab_size, "token_ids")
    if not 1 <= request.start < n:
        raise InvalidArgument(f"start must be in [1, {n - 1}] for {n} token_ids, got {request.start}")
    if n > info.max_model_len:
        raise InvalidArgument(f"{n} token_ids exceed the context window of {info.max_model_len} tokens")
    if not math.isfinite(request.temperature) or request.temperature <= 0:
        raise InvalidArgument(f"temperature must be a finite number > 0, got {request.temperature}")
    if request.return_logits and request.scored * info.vocab_size > MAX_LOGIT_VALUES:
        raise InvalidArgument(
            f"return_logits for {request.scored} tokens x {info.vocab_size} vocab exceeds the limit of "
            f"{MAX_LOGIT_VALUES} values per request; score fewer tokens per request"
        )
    if Capability.SCORE not in info.capabilities:
        raise Unimplemented(
            f"engine {info.engine!r} (replica {info.replica}) cannot score given tokens (capability 'score'); "
            "use an engine that can (embedded, vllm)"
        )


def score_forward(
    model: torch.nn.Module, token_ids: Sequence[int], start: int, temperature: float, want_logits: bool
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32] | None]:
    """One full forward of a Hugging Face causal LM: logprobs (and raw logits) of ``token_ids[start:]``."""
    import torch

    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[0, start:, None]).squeeze(-1)
    return logprobs.numpy().astype("float32"), logits.numpy() if want_logits else None


def score_sync(model: torch.nn.Module, request: ScoreRequest, version: int) -> ScoreResult:
    lp, logits = score_forward(model, request.token_ids, request.start, request.temperature, request.return_logits)
    return ScoreResult(lp, version, logits)


__all__ = ["MAX_LOGIT_VALUES", "ScoreRequest", "ScoreResult", "Scorer", "score_forward", "score_sync", "validate"]
