"""GRPO/PPO utilities for trainers that learn through the bridge.

advantages.py  GRPO, Dr. GRPO, RLOO group baselines; GAE; token broadcasting (numpy)
masks.py       loss mask from a trajectory and token origins; StalenessFilter (max_async_level)
rater.py       reward functions (answer, format, length, tool-trace scoring), combined by envhub.Rubric
sampler.py     prompts -> GRPO groups through StartEpisode(group_size=G), per-member env loop
pipeline.py    sync / async rollout-train scheduling bounded by max_async_level
losses.py      clipped surrogate, k3 KL, clipped value loss (torch)
policy.py      shared-prompt group forward for the trainer; weight export for UpdateWeights
tasks.py       the arithmetic-via-calculator task (environment, rater)

The RL primitives (public names of the RL-primitives document, imported lazily from here):

inference.py     InferenceModule: generate, get_logprobs, get_logits (ScoreTokens), batch_generate_with_tools
environments.py  BaseEnvironment/State, SimpleTextEnvironment, ConversationEnvironment, SVRLEnvironment
                 (the Env Hub's one ``envhub.Environment`` protocol)
rollout.py       RolloutManager/RolloutConfig: parallel collection, progress bar, statistics
rewards.py       RewardComputer (absolute, relative, pareto), ParetoRewardComputer
backprop.py      BackpropModule/BackpropConfig: GAE, clipped/AIPO policy loss, value loss, KL to an EMA/copy reference
algorithms.py    PPOAlgorithm, GRPOAlgorithm, REINFORCEAlgorithm, AlgorithmConfig: one loop, checkpoints, logs
cli.py           ``primerl rl | trainer | orchestrator``
"""

import importlib
import os
from typing import Any

# Passive OpenMP waits before torch loads (see engines/__init__.py: spinning teams collapse on busy cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_PUBLIC = {
    "InferenceModule": "grpo.inference",
    "BaseEnvironment": "grpo.environments",
    "State": "grpo.environments",
    "SimpleTextEnvironment": "grpo.environments",
    "ConversationEnvironment": "grpo.environments",
    "SVRLEnvironment": "grpo.environments",
    "RolloutManager": "grpo.rollout",
    "RolloutConfig": "grpo.rollout",
    "Trajectory": "grpo.rollout",
    "RewardComputer": "grpo.rewards",
    "ParetoRewardComputer": "grpo.rewards",
    "BackpropModule": "grpo.backprop",
    "BackpropConfig": "grpo.backprop",
    "AlgorithmConfig": "grpo.algorithms",
    "PPOAlgorithm": "grpo.algorithms",
    "GRPOAlgorithm": "grpo.algorithms",
    "REINFORCEAlgorithm": "grpo.algorithms",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (``import grpo`` stays free of torch and transformers)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
