"""``grpo.InferenceModule`` against a real bridge child on the toy engine: seeded generation, tool episodes through
the Env Hub's ToolLoop with their token records, and scoring refused by an engine that cannot score."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from grpo import InferenceModule, SVRLEnvironment
from grpo.bridge_proc import bridge_process
from rl_client.errors import BridgeError


@pytest.fixture(scope="module")
def inference() -> Iterator[InferenceModule]:
    with bridge_process("toy") as target:
        module = InferenceModule(target)
        yield module
        module.close()


def test_generate_is_seeded_and_reports_the_rendered_prompt(inference: InferenceModule) -> None:
    a, b = inference.generate(["hi", "hi"], max_tokens=5, seed=7)
    (c,) = inference.generate(["hi"], max_tokens=5, seed=8)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5 and a.logprobs.shape == (5,)
    assert a.prompt_ids and a.prompt_ids == b.prompt_ids and c.token_ids != a.token_ids
    assert inference.client is not None and not inference.client.open_episodes  # nothing left open


def test_tool_episodes_run_through_the_tool_loop(inference: InferenceModule) -> None:
    envs = [SVRLEnvironment(["6*7"], answer_fn=lambda p, a: float(a.strip() == "42")) for _ in range(2)]
    episodes = inference.batch_generate_with_tools(envs, max_tokens=8, seed=3)
    for env, ep in zip(envs, episodes, strict=True):
        assert ep.reasons[-1] in ("final_answer", "max_tool_calls") and env.is_terminal()
        assert ep.trajectory is not None and ep.trajectory.reward == ep.reward == env.state().reward
        assert len(ep.texts) == len(ep.reasons) >= 1


def test_scoring_on_an_engine_that_cannot_score_is_unimplemented(inference: InferenceModule) -> None:
    with pytest.raises(BridgeError) as err:
        inference.get_logprobs([[1, 2, 3]], [[4, 5]])
    assert err.value.code.name == "UNIMPLEMENTED" and "'toy'" in err.value.details
