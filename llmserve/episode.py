"""One episode: the simulator, the shaped reward and the observation, without any server.

Reward of a window (every step), documented in ``docs/llmserve.md``::

    r = 0.5 * min(goodput_tps / ref_tps, 1.5)        # throughput of SLO-meeting requests
      + 0.5 * slo_compliance
      - 0.2 * memory_pressure                         # KV occupancy above 85%, plus evictions
      - 0.2 * min(cost_per_1k / ref_cost, 2)          # GPU dollars per 1k output tokens
      - quality_penalty * min(tps / ref_tps, 1.5)     # quantization's documented quality loss

``ref_tps`` is the task's offered output rate; ``ref_cost`` the cost of one GPU serving it.
"""

from __future__ import annotations

import math

from llmserve.models import ServeAction, ServeObservation
from llmserve.profiles import TIERS
from llmserve.sim import Simulator, WindowStats, capacity
from llmserve.tasks import TaskSpec, generate_workload

MAX_COST_PER_1K = 100.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class Episode:
    """Deterministic in (task, seed, actions)."""

    def __init__(self, spec: TaskSpec, seed: int, mode: str = "sim") -> None:
        self.spec = spec
        self.seed = seed
        self.mode = mode
        workload = generate_workload(spec, seed)
        if mode == "real":  # deterministic in nothing: its windows are measured (llmserve/real.py)
            from llmserve.real import RealBackend

            self.sim: Simulator | RealBackend = RealBackend(spec, workload)
        else:
            self.sim = Simulator(spec, workload)
        self.step_index = 0
        self.total_reward = 0.0

    @property
    def done(self) -> bool:
        return self.step_index >= self.spec.episode_length

    def initial_observation(self) -> ServeObservation:
        return ServeObservation(task_id=self.spec.task_id, reward=0.0, done=False)

    def close(self) -> None:
        close = getattr(self.sim, "close", None)
        if close is not None:
            close()

    def step(self, action: ServeAction) -> ServeObservation:
        st = self.sim.run_window(action)
        self.step_index += 1
        obs = self._observe(action, st)
        self.total_reward += float(obs.reward or 0.0)
        return obs

    def _observe(self, action: ServeAction, st: WindowStats) -> ServeObservation:
        spec = self.spec
        cap = capacity(spec.hardware.memory_gib, action.quantization_tier)
        kv_cap = max(1, self.sim.kv_capacity(action))
        used = self.sim.kv_used()
        occupancy = min(1.0, used / kv_cap)
        window_s = st.elapsed_s or spec.window_s
        tps = st.tokens / window_s
        goodput = st.good_tokens / window_s
        compliance = st.met / st.judged if st.judged else 1.0
        price = spec.hardware.price_per_hour * st.gpu_seconds / 3600
        cost_1k = min(MAX_COST_PER_1K, price / max(st.tokens, 1e-9) * 1000)
        ref_cost = spec.hardware.price_per_hour * spec.window_s / 3600 / (spec.ref_tps * spec.window_s) * 1000
        pressure = max(0.0, occupancy - 0.85) / 0.15 + min(1.0, 0.1 * st.evictions)
        reward = (
            0.5 * min(goodput / spec.ref_tps, 1.5)
            + 0.5 * compliance
            - 0.2 * pressure
            - 0.2 * min(cost_1k / ref_cost, 2.0)
            - TIERS[action.quantization_tier].quality_penalty * min(tps / spec.ref_tps, 1.5)
        )
        memory = cap.weights_bytes + cap.activation_bytes + used * cap.kv_bytes_per_token
        return ServeObservation(
            queue_depth=len(self.sim.waiting),
            active_requests=len(self.sim.running),
            kv_cache_occupancy=occupancy,
            mean_prompt_length=st.prompt_tokens / st.arrivals if st.arrivals else 0.0,
            p50_ttft_ms=_pct(st.ttfts_ms, 0.5),
            p99_ttft_ms=_pct(st.ttfts_ms, 0.99),
            p50_itl_ms=_pct(st.itls_ms, 0.5),
            throughput_tps=tps,
            slo_compliance_rate=compliance,
            gpu_memory_used_gb=memory / 1e9,
            estimated_cost_per_1k=cost_1k,
            request_arrival_rate=st.arrivals / window_s,
            spec_acceptance_rate=spec.spec_alpha if action.speculation_depth else 0.0,
            eviction_events=st.evictions,
            step_index=self.step_index,
            task_id=spec.task_id,
            reward=reward,
            done=self.done,
            metadata=self._metadata(kv_cap, goodput, window_s),
        )

    def _metadata(self, kv_cap: int, goodput: float, window_s: float) -> dict[str, object]:
        meta: dict[str, object] = {"mode": self.mode, "kv_capacity_tokens": kv_cap, "goodput_tps": goodput}
        if self.mode == "real":
            from llmserve.real import NOT_APPLIED

            meta |= {"simulated": list(NOT_APPLIED), "window_wall_s": window_s}
        return meta
