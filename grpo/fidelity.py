"""Training-signal fidelity (issue 38): sample multi-turn groups through a bridge, recompute every sampled token's
logprob with the trainer's forward, and measure how far the two are apart.

``sample_groups`` runs groups of episodes of several turns concurrently (KV reused across turns, sequences of
mixed lengths decoding side by side) and returns their trajectories; ``replay`` runs the same episodes again one
at a time with the same seeds; ``recompute`` feeds the trajectories through ``grpo.policy``'s trainer forward
(``invariant_group_forward`` or the default ``group_forward``) and returns the ``grpo.mismatch`` figures with
``max_abs``. ``tests/integration/test_mismatch_exact.py`` and ``bench/mismatch.py`` are built on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo.mismatch import MismatchMonitor
from rl_client.types import Trajectory

Observation = Callable[[int], list[dict[str, str]]]  # turn index (1, 2, ...) -> the messages appended


def default_observation(turn: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Good. Now step {turn + 1}: say it differently."}]


async def _episode(client: Any, episode_id: str, turns: int, observation: Observation) -> Trajectory:
    for t in range(turns):
        await client.step(episode_id, observation(t) if t else None)
    return await client.end_episode(episode_id)


@dataclass(frozen=True)
class Workload:
    """Groups of episodes: one group of ``group_size`` per prompt, ``turns`` turns each, ``observation(t)`` appended
    before turn ``t`` > 0. Group ``g`` is seeded ``seed + g * group_size`` (member ``i`` samples with that plus ``i``,
    the bridge's rule), so ``replay`` can run each episode again alone."""

    prompts: Sequence[Sequence[int]]
    group_size: int
    turns: int
    sampling: Mapping[str, Any]
    observation: Observation = default_observation
    seed: int = 0


async def sample_groups(client: Any, w: Workload) -> list[Trajectory]:
    """All groups at once; their trajectories in prompt order, members in group order."""

    async def group(g: int, prompt: Sequence[int]) -> list[Trajectory]:
        params = dict(w.sampling) | {"seed": w.seed + g * w.group_size}
        started = await client.start_episode(list(prompt), group_size=w.group_size, sampling=params)
        runs = (_episode(client, ep, w.turns, w.observation) for ep in started.episode_ids)
        return list(await asyncio.gather(*runs))

    groups = await asyncio.gather(*(group(g, p) for g, p in enumerate(w.prompts)))
    return [t for grp in groups for t in grp]


async def replay(client: Any, w: Workload) -> list[Trajectory]:
    """The episodes of ``sample_groups(client, w)`` again, one at a time, in the same order."""
    out = []
    for g, prompt in enumerate(w.prompts):
        for i in range(w.group_size):
            params = dict(w.sampling) | {"seed": w.seed + g * w.group_size + i}
            started = await client.start_episode(list(prompt), sampling=params)
            out.append(await _episode(client, started.episode_ids[0], w.turns, w.observation))
    return out


def recompute(
    model: Any, trajectories: Sequence[Trajectory], *, temperature: float, batch_invariant: bool = True
) -> dict[str, float]:
    """The mismatch figures (``mismatch/...``, lag 0: the model must hold the sampling weights) of every sampled
    token, the trainer's forward against the trajectory's record."""
    import torch

    from grpo.policy import group_forward, invariant_group_forward

    forward = invariant_group_forward if batch_invariant else group_forward
    by_prompt: dict[bytes, list[Trajectory]] = {}
    for t in trajectories:
        by_prompt.setdefault(np.asarray(t.token_ids[: t.prompt_length], np.int64).tobytes(), []).append(t)
    monitor = MismatchMonitor()
    with torch.no_grad():
        for group in by_prompt.values():
            p = group[0].prompt_length
            comps = [np.asarray(t.token_ids[p:], np.int64) for t in group]
            lp = forward(model, group[0].token_ids[:p].tolist(), comps, temperature=temperature).logprobs
            trainer = lp.double().numpy()
            for row, t in enumerate(group):
                sel = np.asarray(t.loss_mask[p:], bool)
                monitor.add(
                    trainer[row, : sel.size][sel],
                    np.asarray(t.logprobs[p:], np.float64)[sel],
                    np.asarray(t.origins[p:])[sel],
                    np.asarray(t.policy_versions[p:])[sel],
                    int(t.policy_versions[p:][sel].max()) if sel.any() else 0,
                )
    return monitor.figures()


__all__ = ["Workload", "default_observation", "recompute", "replay", "sample_groups"]
