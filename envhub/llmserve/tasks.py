"""The three tasks and their seedable workload generators.

A task fixes the episode length, the window each step covers, the GPU, the SLOs and the traffic.
The whole arrival trace of an episode is drawn at reset from ``numpy.random.default_rng(seed)``,
so the workload never depends on the agent's actions and the same seed gives the same requests.

* ``static_workload`` (easy): Poisson arrivals at a stable rate, short prompts, one class.
* ``bursty_workload`` (medium): a two-state Markov-modulated Poisson process (MMPP): a calm and a
  burst rate, switching between windows with fixed probabilities.
* ``adversarial_multitenant`` (hard): an interactive tenant (priority 0: short prompts, tight TTFT)
  and a batch tenant (priority 1: long prompts), sharp spikes of long prompts, and a 40 GB GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envhub.llmserve.profiles import A100_40G, A100_80G, Hardware


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float
    prompt_len: int
    output_len: int
    priority: int  # 0 = interactive (served first under priority routing), 1 = batch


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    difficulty: str
    description: str
    episode_length: int
    window_s: float
    hardware: Hardware
    ttft_slo_ms: tuple[float, float]  # per priority class
    itl_slo_ms: float
    spec_alpha: float  # draft acceptance rate of this traffic
    calm_rate: float  # requests/s
    burst_rate: float  # requests/s in the MMPP burst state (== calm_rate: no bursts)
    p_enter_burst: float
    p_leave_burst: float
    prompt_mean: float
    output_mean: float
    batch_share: float  # fraction of requests from the batch tenant (priority 1, long prompts)
    spike_prob: float  # per window: a spike of long batch prompts
    spike_size: int

    @property
    def ref_tps(self) -> float:
        """Offered output tokens/s at the mean rate: the throughput term's unit."""
        return max(1.0, self.calm_rate * self.output_mean)


TASKS: dict[str, TaskSpec] = {
    "static_workload": TaskSpec(
        task_id="static_workload",
        difficulty="easy",
        description="Stable Poisson arrivals (6 req/s), short prompts (~256 tokens), one class, A100-80GB.",
        episode_length=32,
        window_s=1.0,
        hardware=A100_80G,
        ttft_slo_ms=(500.0, 500.0),
        itl_slo_ms=60.0,
        spec_alpha=0.75,
        calm_rate=6.0,
        burst_rate=6.0,
        p_enter_burst=0.0,
        p_leave_burst=1.0,
        prompt_mean=256.0,
        output_mean=96.0,
        batch_share=0.0,
        spike_prob=0.0,
        spike_size=0,
    ),
    "bursty_workload": TaskSpec(
        task_id="bursty_workload",
        difficulty="medium",
        description="MMPP arrivals: 3 req/s calm, 18 req/s bursts; ~512-token prompts, A100-80GB.",
        episode_length=48,
        window_s=1.0,
        hardware=A100_80G,
        ttft_slo_ms=(1000.0, 1000.0),
        itl_slo_ms=70.0,
        spec_alpha=0.65,
        calm_rate=3.0,
        burst_rate=18.0,
        p_enter_burst=0.15,
        p_leave_burst=0.35,
        prompt_mean=512.0,
        output_mean=128.0,
        batch_share=0.0,
        spike_prob=0.0,
        spike_size=0,
    ),
    "adversarial_multitenant": TaskSpec(
        task_id="adversarial_multitenant",
        difficulty="hard",
        description=(
            "Two tenants (interactive priority 0 with a 300 ms TTFT SLO; batch priority 1 with ~1500-token "
            "prompts), sharp spikes of long prompts, tight memory (A100-40GB)."
        ),
        episode_length=48,
        window_s=1.0,
        hardware=A100_40G,
        ttft_slo_ms=(300.0, 3000.0),
        itl_slo_ms=80.0,
        spec_alpha=0.55,
        calm_rate=6.0,
        burst_rate=6.0,
        p_enter_burst=0.0,
        p_leave_burst=1.0,
        prompt_mean=160.0,
        output_mean=96.0,
        batch_share=0.3,
        spike_prob=0.12,
        spike_size=12,
    ),
}


class UnknownTaskError(ValueError):
    """Reset named a task that does not exist; the message lists the tasks."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"unknown task {task_id!r}; tasks: {', '.join(TASKS)}")


def get_task(task_id: str) -> TaskSpec:
    if task_id not in TASKS:
        raise UnknownTaskError(task_id)
    return TASKS[task_id]


def _lognormal_len(rng: np.random.Generator, mean: float, lo: int, hi: int) -> int:
    # sigma 0.6: a right-skewed length distribution like ShareGPT's, with the requested mean.
    sigma = 0.6
    return int(np.clip(rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma), lo, hi))


def generate_workload(spec: TaskSpec, seed: int) -> list[list[Request]]:
    """Arrivals per window, sorted by arrival time; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    windows: list[list[Request]] = []
    burst = False
    rid = 0
    for w in range(spec.episode_length):
        burst = bool(rng.random() < (1 - spec.p_leave_burst if burst else spec.p_enter_burst))
        rate = spec.burst_rate if burst else spec.calm_rate
        n = int(rng.poisson(rate * spec.window_s))
        spike = spec.spike_size if rng.random() < spec.spike_prob else 0
        start = w * spec.window_s
        reqs: list[Request] = []
        for i in range(n + spike):
            is_batch = i >= n or rng.random() < spec.batch_share
            prompt_mean = 1500.0 if is_batch else spec.prompt_mean
            arrival = start + (0.0 if i >= n else float(rng.random()) * spec.window_s)
            reqs.append(
                Request(
                    rid=rid,
                    arrival_s=arrival,
                    prompt_len=_lognormal_len(rng, prompt_mean, 16, 3072),
                    output_len=_lognormal_len(rng, spec.output_mean, 8, 512),
                    priority=1 if is_batch and spec.batch_share > 0 else 0,
                )
            )
            rid += 1
        windows.append(sorted(reqs, key=lambda r: (r.arrival_s, r.rid)))
    return windows
