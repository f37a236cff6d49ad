"""Speculation through the bridge (embedded SmolLM2): greedy tool-call turns are token-identical with drafts on
and off, accepted drafts carry origin draft_accepted and count as policy samples (loss mask 1)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.spec_workload import episodes

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


async def _turns(start_bridge: Any, speculation: dict[str, Any]) -> list[Any]:
    _, client = await start_bridge(
        engine={"type": "embedded", "embedded": {"max_model_len": 2048}}, speculation=speculation
    )
    out = []
    for ep in episodes(3):
        messages = [{"role": m.role, "content": m.content} for m in ep.messages]
        started = await client.start_episode(
            messages, tools=list(ep.tool_schemas), sampling={"temperature": 0, "max_tokens": 40}
        )
        await client.step(started.episode_id)
        out.append(await client.end_episode(started.episode_id))
    return out


async def test_greedy_turns_are_identical_with_speculation_and_drafts_are_recorded(start_bridge: Any) -> None:
    plain = await _turns(start_bridge, {"enabled": False})
    spec = await _turns(start_bridge, {"enabled": True, "drafters": ["grammar", "ngram"]})
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs[a.loss_mask], b.logprobs[b.loss_mask], atol=2e-3)
    names = [n for t in spec for n in t.origin_names()]
    assert "draft_accepted" in names  # the tool-call spans were drafted and accepted
    for t in spec:
        drafted = np.array([n == "draft_accepted" for n in t.origin_names()])
        assert t.loss_mask[drafted].all()
    assert all(n in ("prompt", "sampled") for t in plain for n in t.origin_names())
