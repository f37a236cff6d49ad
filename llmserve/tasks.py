"""The three tasks and their seedable workload generators.

The tasks are data (``data/tasks.json``, shipped as package data). A task fixes the episode length, the
window each step covers, the GPU, the SLOs and the traffic.
The whole arrival trace of an episode is drawn at reset from ``numpy.random.default_rng(seed)``,
so the workload never depends on the agent's actions and the same seed gives the same requests.

* ``static_workload`` (easy): Poisson arrivals at a stable rate, short prompts, one class.
* ``bursty_workload`` (medium): a two-state Markov-modulated Poisson process (MMPP): a calm and a
  burst rate, switching between windows with fixed probabilities.
* ``adversarial_multitenant`` (hard): an interactive tenant (priority 0: short prompts, tight TTFT)
  and a batch tenant (priority 1: long prompts), sharp spikes of long prompts, and a 40 GB GPU.
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass

import numpy as np

from llmserve.profiles import HARDWARE, Hardware


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


def _load_tasks() -> dict[str, TaskSpec]:
    """The task table, ``data/tasks.json`` (package data): one object per task with ``TaskSpec``'s fields, the
    GPU by its name (``profiles.HARDWARE``)."""
    text = importlib.resources.files("llmserve").joinpath("data/tasks.json").read_text()
    specs = (
        TaskSpec(**{**row, "hardware": HARDWARE[row["hardware"]], "ttft_slo_ms": tuple(row["ttft_slo_ms"])})
        for row in json.loads(text)
    )
    return {spec.task_id: spec for spec in specs}


TASKS: dict[str, TaskSpec] = _load_tasks()


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
