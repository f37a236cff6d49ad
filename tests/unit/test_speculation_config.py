"""Speculation config, schema parsing and the factory's on/off switch (no tokenizer needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from envhub.envs.sql_qa import SQL_TOOL
from server.config import load_settings
from speculation.config import SpeculationConfig
from speculation.factory import SpeculationFactory, grammar_from_schemas


def test_defaults_keep_speculation_off_and_settings_nest_it() -> None:
    assert SpeculationConfig().enabled is False
    settings = load_settings(speculation={"enabled": True, "max_draft_tokens": 4})
    assert settings.speculation.enabled and settings.speculation.max_draft_tokens == 4
    with pytest.raises(ValidationError):
        SpeculationConfig(mode="always")
    with pytest.raises(ValidationError):
        SpeculationConfig(max_draft_tokens=0)


def test_grammar_from_openai_and_bare_schemas() -> None:
    g = grammar_from_schemas([SQL_TOOL.to_json(), json.dumps({"name": "ping"})])
    assert g is not None and g.tool_names == ("sql_query", "ping")
    assert g.tools[0][1] == dict(SQL_TOOL.parameters)
    assert grammar_from_schemas(["not json"]) is None
    assert grammar_from_schemas([json.dumps({"description": "no name"})]) is None
    assert grammar_from_schemas([]) is None


def test_factory_returns_no_drafter_when_disabled_or_constrained() -> None:
    # The tokenizer is only touched when a grammar is compiled, so None is enough here.
    assert SpeculationFactory(SpeculationConfig(), None).drafter([SQL_TOOL.to_json()]) is None
    assert SpeculationFactory(SpeculationConfig(enabled=True, mode="constrained"), None).drafter() is None
    drafter = SpeculationFactory(SpeculationConfig(enabled=True), None).drafter()
    assert drafter is not None and drafter.tracker is None  # no tools: n-gram drafts only
    assert drafter.draft([1, 2, 3, 1, 2], 4) == (3, 1, 2)


def test_constrained_mode_is_refused_on_engines_that_cannot_mask() -> None:
    """Only the embedded engine decodes under a grammar mask: the others would silently ignore it."""
    from core.errors import InvalidArgument
    from engines.config import ToyConfig
    from engines.toy import ToyEngine
    from server.bridge import Bridge
    from server.config import AdmissionConfig, SamplingDefaults

    constrained: dict[str, Any] = {"enabled": True, "mode": "constrained"}
    for engine in ("toy", "vllm", "sglang", "trtllm"):
        with pytest.raises(ValueError, match=r"needs engine\.type 'embedded'"):  # a ConfigError
            load_settings(engine={"type": engine}, speculation=constrained)
    assert load_settings(engine={"type": "embedded"}, speculation=constrained).speculation.mode == "constrained"
    assert load_settings(engine={"type": "vllm"}, speculation={"enabled": True}).speculation.mode == "draft-only"
    # Engines handed to the bridge directly: refused by capability (EngineInfo.supports_constraints).
    toy = ToyEngine(ToyConfig())
    assert not toy.info.supports_constraints
    with pytest.raises(InvalidArgument, match="cannot: use mode 'draft-only'"):
        Bridge([toy], AdmissionConfig(), SamplingDefaults(), speculation=SpeculationConfig(**constrained))
    assert Bridge([toy], AdmissionConfig(), SamplingDefaults(), speculation=SpeculationConfig(enabled=True)).speculation


def test_draft_only_on_replicas_that_cannot_verify_is_said_at_start_and_sends_no_drafter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dataclasses import replace

    from core.types import Capability, GenerateRequest, SamplingParams
    from engines.config import ToyConfig
    from engines.toy import ToyEngine
    from server.bridge import Bridge
    from server.config import AdmissionConfig, SamplingDefaults
    from server.episodes import Episode

    toy = ToyEngine(ToyConfig())
    toy.info = replace(toy.info, capabilities=toy.info.capabilities - {Capability.DRAFT_VERIFY})
    with caplog.at_level("WARNING", logger="primerl.server"):
        bridge = Bridge([toy], AdmissionConfig(), SamplingDefaults(), speculation=SpeculationConfig(enabled=True))
    assert "cannot verify drafts (capability 'draft_verify')" in caplog.text
    episode = Episode("ep", "", "toy", "g", 0, 0, SamplingParams(), {}, tool_schemas=('{"name": "f"}',))
    turn, params = bridge.turns.open(episode, [1, 2], SamplingParams(max_tokens=4), False)
    request: GenerateRequest = bridge.turns._request(episode, turn, params, None)
    assert request.drafter is None


def test_masked_positions_merge_per_turn_and_ignore_tokens_that_never_arrived() -> None:
    from types import SimpleNamespace

    from speculation.factory import MASKED_POSITIONS_KEY, record_masked_positions

    metadata = {MASKED_POSITIONS_KEY: "not json", "run": "a"}  # a client's value under the key is replaced
    record_masked_positions(metadata, SimpleNamespace(steps={12: 1, 10: 40}), length=13)
    record_masked_positions(metadata, SimpleNamespace(steps={12: 1, 10: 40}), length=13)  # idempotent
    record_masked_positions(metadata, SimpleNamespace(steps={30: 5, 31: 1}), length=31)  # 31 never arrived
    assert json.loads(metadata[MASKED_POSITIONS_KEY]) == {"10": 40, "12": 1, "30": 5} and metadata["run"] == "a"
    record_masked_positions(metadata, SimpleNamespace(steps={}), length=40)
    assert json.loads(metadata[MASKED_POSITIONS_KEY]) == {"10": 40, "12": 1, "30": 5}
