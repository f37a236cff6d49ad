"""Teacher-forced scoring on a vLLM server through prompt logprobs (``engines.scoring``).

``POST /v1/completions`` with the sequence as ``prompt``, ``max_tokens = 1`` and ``prompt_logprobs = 1``:
entry ``i`` of ``choices[0].prompt_logprobs`` holds the logprob of prompt token ``i`` (and the argmax).
vLLM computes prompt logprobs from the raw logits, so only ``temperature == 1`` is served; other
temperatures and ``return_logits`` (vLLM returns no full logits) are UNIMPLEMENTED, naming the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.errors import Unimplemented
from engines.scoring import ScoreRequest, ScoreResult

if TYPE_CHECKING:
    from engines.http.vllm import VllmEngine


async def score(engine: VllmEngine, request: ScoreRequest) -> ScoreResult:
    if request.return_logits:
        raise Unimplemented(f"{engine.label} cannot return logits (vLLM reports logprobs only); ask for logprobs")
    if request.temperature != 1.0:
        raise Unimplemented(
            f"{engine.label} scores the raw distribution only (vLLM prompt logprobs ignore temperature); "
            f"got temperature {request.temperature}"
        )
    version = engine.policy_version
    payload = {
        "model": engine.served_model_name,
        "prompt": list(request.token_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    response = await engine.request("POST", "/v1/completions", json_body=payload)
    w = engine.wire
    body = w.obj(w.loads(response.text, "score response"), "score response")
    choices = w.list_(body.get("choices"), "choices")
    if len(choices) != 1:
        raise w.fail("choices", f"has {len(choices)} entries for a request with n=1")
    scored = w.list_(w.obj(choices[0], "choices[0]").get("prompt_logprobs"), "choices[0].prompt_logprobs")
    if len(scored) != len(request.token_ids):
        raise w.fail("choices[0].prompt_logprobs", f"has {len(scored)} entries for {len(request.token_ids)} tokens")
    out = np.empty(request.scored, dtype=np.float32)
    for j, i in enumerate(range(request.start, len(request.token_ids))):
        where = f"choices[0].prompt_logprobs[{i}]"
        entry = w.obj(scored[i], where).get(str(request.token_ids[i]))
        out[j] = w.logprob(w.obj(entry, f"{where}[{request.token_ids[i]}]").get("logprob"), f"{where}.logprob")
    return ScoreResult(out, version)
