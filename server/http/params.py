"""Request fields -> the bridge's sampling overrides, stop strings and choice count.

The OpenAI routes carry sampling as top-level fields (``Sampling``); vLLM's token route carries a vLLM
``SamplingParams`` object whose unknown keys are accepted and logged once per name (never a 400: the
ecosystem's clients send engine-specific knobs). A field the engines cannot honour with a non-neutral
value (a presence penalty) is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, ValidationError

from core.types import MIN_TEMPERATURE, SamplingOverrides
from server.http.errors import BadParam, error_for_validation
from server.http.models import SEED, Sampling, _Open

log = logging.getLogger("primerl.server.http")
_logged: set[str] = set()
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class VllmSampling(_Open):
    """The keys of vLLM's ``SamplingParams`` the bridge honours (others: accepted, logged once)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = SEED
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int = Field(1, ge=1)
    logprobs: int | None = Field(None, ge=0)


def _overrides(s: Sampling | VllmSampling, max_tokens: int | None) -> SamplingOverrides:
    if s.temperature is not None and 0 < s.temperature < MIN_TEMPERATURE:  # logits / it overflow
        param = "sampling_params.temperature" if isinstance(s, VllmSampling) else "temperature"
        raise BadParam(param, f"{param} must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {s.temperature}")
    top_k = s.top_k if s.top_k != -1 else 0  # vLLM: -1 disables top-k
    return SamplingOverrides(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=top_k,
        min_p=s.min_p,
        max_tokens=max_tokens,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids or ()),
        ignore_eos=s.ignore_eos,
    )


def stops(stop: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
    values = [stop] if isinstance(stop, str) else list(stop or ())
    for i, s in enumerate(values):
        if not s:
            raise BadParam(param, f"{param}[{i}] is empty; stop strings must be non-empty")
    return tuple(values)


def openai_sampling(body: Sampling, max_tokens: int | None = None) -> SamplingOverrides:
    """An OpenAI body's sampling fields (``max_tokens`` wins over the body's when given)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, NEUTRAL[name]):
            raise BadParam(name, f"{name} = {value} is not supported by the bridge's engines; leave it 0")
    return _overrides(body, max_tokens if max_tokens is not None else body.max_tokens)


def vllm_sampling(raw: dict[str, Any]) -> tuple[SamplingOverrides, VllmSampling]:
    """vLLM ``sampling_params`` as overrides (and the parsed object: ``n``, ``stop``, ``logprobs``)."""
    try:
        params = VllmSampling.model_validate(raw)
    except ValidationError as exc:
        raise error_for_validation(exc, "sampling_params") from None
    for key in sorted(params.model_extra or {}):
        if key not in _logged:
            _logged.add(key)
            log.info("sampling_params.%s is not used by the bridge (accepted and ignored; logged once)", key)
    return _overrides(params, params.max_tokens), params
