"""Engines declare what they can do; a request needing something else is refused, naming engine and capability."""

from __future__ import annotations

import dataclasses

import pytest

from core.errors import Unimplemented
from core.types import Capability, SamplingParams, check_capabilities
from engines.config import ToyConfig
from engines.http.sglang import SglangEngine
from engines.http.trtllm import TrtllmEngine
from engines.http.vllm import VllmEngine
from engines.toy import ToyEngine


def test_a_field_at_its_default_needs_nothing_and_a_set_one_needs_its_capability() -> None:
    bare = dataclasses.replace(ToyEngine(ToyConfig()).info, engine="bare", replica="bare-0", capabilities=frozenset())
    check_capabilities(bare, SamplingParams(temperature=0.5, top_k=3, seed=1))  # nothing special asked
    with pytest.raises(Unimplemented, match=r"engine 'bare' \(replica bare-0\) .*sampling.min_p .*'min_p'"):
        check_capabilities(bare, SamplingParams(min_p=0.1))
    with pytest.raises(Unimplemented, match=r"sampling.raw_logprobs .*'raw_logprobs'"):
        check_capabilities(bare, SamplingParams(raw_logprobs=True))
    with pytest.raises(Unimplemented, match=r"sampling.kept_mass .*'kept_mass'"):
        check_capabilities(bare, SamplingParams(kept_mass=True))


def test_declared_capabilities() -> None:
    toy = ToyEngine(ToyConfig()).info
    check_capabilities(toy, SamplingParams(min_p=0.2, raw_logprobs=True, kept_mass=True))
    assert toy.supports_weight_updates and not toy.supports_constraints
    assert not ToyEngine(ToyConfig(supports_weight_updates=False)).info.supports_weight_updates
    # No remote engine reports raw logprobs next to processed ones: none may claim it (it was silently dropped).
    for cls in (VllmEngine, SglangEngine, TrtllmEngine):
        assert Capability.MIN_P in cls.capabilities and Capability.RAW_LOGPROBS not in cls.capabilities
        assert Capability.KEPT_MASS not in cls.capabilities  # nor the kept mass (vLLM: one logprobs_mode per server)
    assert Capability.WEIGHT_UPDATES not in TrtllmEngine.capabilities
    assert Capability.DRAFT_VERIFY in VllmEngine.capabilities
