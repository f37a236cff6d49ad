"""``sampling.kept_mass`` (issue 38): each sampled token carries the log of the probability mass the sampler's
filters kept, so that ``logprob + kept_logmass`` is the token's logprob under the untruncated temperature-scaled
distribution. Checked through a real bridge on the toy engine against its exact tables, for top-p 0.9 and
top-k 20, over two turns of a group (the trajectory's float32 arrays, to 1e-6)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from engines.sampling import log_softmax

TEMPERATURE = 0.7


@pytest.mark.parametrize("cut", [{"top_p": 0.9}, {"top_k": 20}], ids=["top_p_0.9", "top_k_20"])
async def test_logprob_plus_kept_mass_is_the_exact_untruncated_logprob(bridge: Any, cut: dict[str, Any]) -> None:
    server, client = bridge
    engine = server.bridge.engines[0]
    sampling = {"temperature": TEMPERATURE, "max_tokens": 40, "seed": 3, "ignore_eos": True, "kept_mass": True} | cut
    started = await client.start_episode([5, 6, 7], group_size=4, sampling=sampling)

    async def run(ep: str) -> Any:
        first = await client.step(ep)
        assert first.kept_logmass is not None and len(first.kept_logmass) == len(first.token_ids)
        await client.step(ep, [8, 9])
        return await client.end_episode(ep)

    trajectories = await asyncio.gather(*(run(ep) for ep in started.episode_ids))
    checked, cut_tokens = 0, 0
    for t in trajectories:
        assert t.kept_logmass is not None and len(t.kept_logmass) == len(t)
        for i in range(len(t)):
            if not t.loss_mask[i]:
                assert math.isnan(t.kept_logmass[i])  # prompt and observation tokens: not sampled
                continue
            exact = float(log_softmax(engine.logits(t.token_ids[:i].tolist()) / TEMPERATURE)[t.token_ids[i]])
            assert abs(float(t.logprobs[i]) + float(t.kept_logmass[i]) - exact) <= 1e-6, (i, t.kept_logmass[i])
            assert t.kept_logmass[i] <= 0.0
            checked += 1
            cut_tokens += bool(t.kept_logmass[i] < 0)
    assert checked == 4 * 80 and cut_tokens > checked // 2  # the filters cut the distribution at most steps


async def test_without_kept_mass_nothing_is_reported(bridge: Any) -> None:
    _, client = bridge
    ep = (await client.start_episode([5, 6], sampling={"top_p": 0.9, "max_tokens": 4})).episode_ids[0]
    assert (await client.step(ep)).kept_logmass is None
    assert (await client.end_episode(ep)).kept_logmass is None
