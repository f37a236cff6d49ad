"""The llm agent's pure parts: the reply parser, the settings from the environment, the counts, the CLI error."""

from __future__ import annotations

import json

import pytest

from llmserve.agents import make_agent
from llmserve.llm import SYSTEM_PROMPT, LLMConfig, LLMEndpointError, LLMStats, parse_action
from llmserve.models import ServeAction
from server.cli import main

GOOD = {"batch_cap": 48, "kv_budget_fraction": 0.8, "speculation_depth": 2, "quantization_tier": "INT8",
        "prefill_decode_split": False, "priority_routing": True}  # fmt: skip
EXPECTED = ServeAction(**GOOD)


@pytest.mark.parametrize(
    "reply",
    [
        json.dumps(GOOD),
        f"Given the queue, I pick {json.dumps(GOOD)} for this window.",
        f"```json\n{json.dumps(GOOD, indent=2)}\n```",
        f'Observation was {{"queue_depth": 3}}; action: {{"action": {json.dumps(GOOD)}}}',  # nested, after another
    ],
)
def test_a_json_action_in_the_reply_is_parsed(reply: str) -> None:
    assert parse_action(reply) == EXPECTED


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "increase the batch size and turn on speculation",
        "{batch_cap: 48}",  # not JSON
        json.dumps(GOOD)[:-1],  # cut off by max_tokens
        json.dumps({**GOOD, "batch_cap": 4096}),  # out of range
        json.dumps({**GOOD, "kv_budget_fraction": 0.05}),
        json.dumps({**GOOD, "quantization_tier": "FP4"}),
        json.dumps({**GOOD, "batch_cap": "many"}),
        json.dumps({k: v for k, v in GOOD.items() if k != "priority_routing"}),  # a field missing
        json.dumps({**GOOD, "gpus": 2}),  # an unknown field
        json.dumps({**GOOD, "batch_cap": 4096}) + " or rather " + json.dumps(GOOD),  # the first action counts
    ],
)
def test_an_unusable_reply_is_none_not_an_exception(reply: str) -> None:
    assert parse_action(reply) is None


def test_the_prompt_gives_every_field_with_its_range_and_a_parsable_example() -> None:
    for text in ("batch_cap", "1..512", "0.1..1.0", "0..8", "FP16|INT8|INT4", "prefill_decode_split"):
        assert text in SYSTEM_PROMPT
    assert parse_action(SYSTEM_PROMPT.split("Example reply: ")[1]) == ServeAction()


def test_settings_come_from_the_environment_and_name_the_missing_variable() -> None:
    with pytest.raises(LLMEndpointError, match="needs OPENAI_BASE_URL"):
        LLMConfig.from_env({"OPENAI_API_KEY": "k"})
    assert LLMConfig.from_env({"OPENAI_BASE_URL": "http://h:8000/v1"}) == LLMConfig(base_url="http://h:8000/v1")
    env = {"OPENAI_BASE_URL": "http://h/v1", "OPENAI_API_KEY": "k", "OPENAI_MODEL": "m"}
    assert LLMConfig.from_env(env) == LLMConfig(base_url="http://h/v1", api_key="k", model="m")


def test_counts_add_and_summarise() -> None:
    total = LLMStats(20, 3, 17, "m") + LLMStats(12, 0, 12, "m")
    assert total == LLMStats(32, 3, 29) and total.model == "m"
    assert LLMStats(20, 3, 17).summary() == "llm: 20 windows, 3 parsed, 17 fell back to the heuristic"


def test_without_an_endpoint_make_agent_and_the_cli_say_which_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(LLMEndpointError, match="OPENAI_BASE_URL"):
        make_agent("llm")
    with pytest.raises(SystemExit, match=r"^error: the llm agent needs OPENAI_BASE_URL"):
        main(["llmserve", "evaluate", "--agent", "llm", "--task", "static_workload", "--episodes", "1"])
