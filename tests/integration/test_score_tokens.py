"""``ScoreTokens`` and ``InferenceModule.get_logprobs`` / ``get_logits`` (issue 23, acceptance 5, embedded).

A real bridge child on the embedded engine scores prompt + response pairs; the reference is the trainer's
own forward pass (``grpo.policy.group_forward``, the one the GRPO trainer takes gradients through) on an
independently loaded fp32 model. The toy engine (no ``score`` capability) answers UNIMPLEMENTED naming it;
bad input is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from grpo.bridge_proc import bridge_process
from grpo.inference import InferenceModule
from rl_client.errors import BridgeError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

PROMPTS = ["What is 2+2?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
RESPONSES = ["2+2 is 4.", "Blue, the colour of the sky on a clear day."]


@pytest.fixture(scope="module")
def model() -> Any:
    from engines.model_store import ensure_converted, load_model_and_tokenizer

    m, _ = load_model_and_tokenizer(ensure_converted())
    return m.eval()


@pytest.fixture(scope="module")
def remote() -> Iterator[InferenceModule]:
    with bridge_process("embedded") as target:
        inference = InferenceModule(target)
        yield inference
        inference.close()


def trainer_logprobs(model: Any, inference: InferenceModule, temperature: float) -> list[np.ndarray]:
    from grpo.policy import group_forward

    out = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES, strict=True):
            fwd = group_forward(model, inference.prompt_ids(p), [inference.response_ids(r)], temperature=temperature)
            out.append(fwd.logprobs[0].numpy())
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bridge_logprobs_equal_the_trainer_forward(remote: InferenceModule, model: Any, temperature: float) -> None:
    got = remote.get_logprobs(PROMPTS, RESPONSES, temperature=temperature)
    ref = trainer_logprobs(model, remote, temperature)
    for g, r, text in zip(got, ref, RESPONSES, strict=True):
        assert g.shape == r.shape == (len(remote.response_ids(text)),)
        assert float(np.max(np.abs(g - r))) <= 1e-4
    local = InferenceModule(model, tokenizer=remote.tokenizer).get_logprobs(PROMPTS, RESPONSES, temperature)
    for lo, r in zip(local, ref, strict=True):
        assert float(np.max(np.abs(lo - r))) <= 1e-4


@pytest.mark.timeout(900)
def test_bridge_logits_are_the_models(remote: InferenceModule, model: Any) -> None:
    (logits,) = remote.get_logits(PROMPTS[:1], RESPONSES[:1])
    ids = remote.prompt_ids(PROMPTS[0])
    resp = remote.response_ids(RESPONSES[0])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids + resp])).logits[0, len(ids) - 1 : -1].float().numpy()
    assert logits.shape == ref.shape == (len(resp), model.config.vocab_size)
    assert float(np.max(np.abs(logits - ref))) <= 1e-3
    # the logprobs are the log-softmax of those logits at the response tokens
    lp = remote.get_logprobs(PROMPTS[:1], RESPONSES[:1])[0]
    ref_lp = torch.log_softmax(torch.tensor(logits), -1)[torch.arange(len(resp)), torch.tensor(resp)].numpy()
    assert float(np.max(np.abs(lp - ref_lp))) <= 1e-4


@pytest.mark.timeout(900)
def test_bad_score_requests_name_the_field(remote: InferenceModule) -> None:
    assert remote.client is not None
    cases = [
        ({"token_ids": [1, 2, 3], "start": 0}, "start"),
        ({"token_ids": [1], "start": 1}, "token_ids"),
        ({"token_ids": [1, 2, 10**8], "start": 1}, "token_ids"),
        ({"token_ids": [1, 2, 3], "start": 1, "temperature": 0.0}, "temperature"),
    ]
    for kw, field in cases:
        with pytest.raises(BridgeError) as err:
            remote.client.score_tokens(**kw)
        assert err.value.code.name == "INVALID_ARGUMENT" and field in err.value.details, err.value


async def test_engines_without_scoring_answer_unimplemented(start_bridge: Any) -> None:
    _, client = await start_bridge()
    with pytest.raises(BridgeError) as err:
        await client.score_tokens([1, 2, 3], 1)
    assert err.value.code.name == "UNIMPLEMENTED" and "'toy'" in err.value.details and "score" in err.value.details
