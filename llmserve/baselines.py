"""The baseline agents the grader normalises between (``llmserve.grader``), and what every agent is.

``RandomAgent`` (the floor): every field uniform over its range, from ``random.Random(seed)``.

``HeuristicAgent`` (the reference), rules in the spirit of Orca / vLLM defaults:

* batch cap: twice the work in flight, between 16 and 64 (Orca-style bounded batches: larger
  batches break the inter-token-latency SLO on this profile);
* KV budget: vLLM's ``gpu_memory_utilization`` 0.9; 1.0 after evictions or above 90% occupancy;
* speculation: depth 3 while fewer than 32 sequences run (decode is memory-bound there) and the
  observed acceptance is at least 0.5; off under load;
* quantization: FP16; INT8 when memory is the bottleneck (evictions or occupancy above 90%) or
  32+ sequences decode (memory-bound decode runs ~30% faster on INT8 weights);
* prefill/decode split: when prompts are long (mean > 1000 tokens);
* priority routing: always on (it never hurts a single-class task).

The heuristic is also the PPO agent's warm start (``llmserve.ppo``) and the ``llm`` agent's fallback
(``llmserve.llm``); ``llmserve.agents`` builds any agent by name.
"""

from __future__ import annotations

import random
from typing import Protocol

from llmserve.models import ServeAction, ServeObservation
from llmserve.profiles import QuantTier


class Agent(Protocol):
    name: str

    def act(self, obs: ServeObservation) -> ServeAction: ...


class RandomAgent:
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def act(self, obs: ServeObservation) -> ServeAction:
        r = self._rng
        return ServeAction(
            batch_cap=r.randint(1, 512),
            kv_budget_fraction=round(r.uniform(0.1, 1.0), 4),
            speculation_depth=r.randint(0, 8),
            quantization_tier=r.choice(list(QuantTier)),
            prefill_decode_split=r.random() < 0.5,
            priority_routing=r.random() < 0.5,
        )


class HeuristicAgent:
    name = "heuristic"

    def act(self, obs: ServeObservation) -> ServeAction:
        in_flight = obs.queue_depth + obs.active_requests
        pressure = obs.eviction_events > 0 or obs.kv_cache_occupancy > 0.9
        acceptance_ok = obs.spec_acceptance_rate >= 0.5 or obs.step_index == 0
        return ServeAction(
            batch_cap=min(64, max(16, 2 * in_flight)),
            kv_budget_fraction=1.0 if pressure else 0.9,
            speculation_depth=3 if obs.active_requests < 32 and acceptance_ok else 0,
            quantization_tier=QuantTier.INT8 if pressure or obs.active_requests >= 32 else QuantTier.FP16,
            prefill_decode_split=obs.mean_prompt_length > 1000,
            priority_routing=True,
        )
