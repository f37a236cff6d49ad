"""GRPO/PPO utilities for trainers that learn through the bridge.

advantages.py  GRPO, Dr. GRPO, RLOO group baselines; GAE; token broadcasting (numpy)
masks.py       loss mask from a trajectory and token origins; StalenessFilter (max_async_level)
rater.py       reward functions (answer, format, length, tool-trace scoring), combined by envhub.Rubric
sampler.py     prompts -> GRPO groups through StartEpisode(group_size=G), per-member env loop
pipeline.py    sync / async rollout-train scheduling bounded by max_async_level
losses.py      clipped surrogate, k3 KL, clipped value loss (torch)
policy.py      shared-prompt group forward for the trainer; weight export for UpdateWeights
tasks.py       the arithmetic-via-calculator task (environment, rater)

The reference trainers are examples/grpo_train.py (`make run`) and examples/ppo_train.py.
"""

import os

# Passive OpenMP waits before torch loads (see engines/__init__.py: spinning teams collapse on busy cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
