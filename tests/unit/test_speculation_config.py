"""Speculation config, schema parsing and the factory's on/off switch (no tokenizer needed)."""

from __future__ import annotations

import json

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
