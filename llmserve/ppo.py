"""PPO for LLMServeEnv on the simulator, CPU-only (torch).

Design (documented in ``docs/llmserve.md``):

* **Observation** → 20 features: the ``ServeObservation`` numbers, log-scaled or divided by a fixed
  unit so they sit near [0, 1] (``features``), the step fraction and the task's one-hot.
* **Action**: factorised categorical heads over a discretised ``ServeAction`` (``LEVELS``): batch
  cap, KV budget, speculation depth 0..4, quantization tier, prefill/decode split, priority routing.
* **Net**: a small MLP actor-critic (two tanh layers of 64), one logit group per head.
* **Warm start**: behaviour cloning of ``HeuristicAgent`` (cross-entropy per head on the
  heuristic's own states, value regression on its discounted returns), so PPO starts at the
  heuristic's (discretised) policy and improves on it rather than from a random policy.
* **PPO**: rollouts of whole episodes on training seeds (``TRAIN_SEED_BASE + i``, never the
  benchmark's held-out seeds), GAE (gamma, lambda), clipped surrogate, value loss, entropy bonus.
  Every ``eval_every`` iterations the greedy policy (argmax per head) is scored on validation
  seeds (also training-range seeds) and the best one is what gets saved: BC's greedy policy is
  the first candidate, so a PPO phase that does not help cannot make the saved policy worse there.
* **Determinism**: ``torch.manual_seed(seed)`` + ``numpy`` generator; the greedy agent is a pure
  function of the weights, so evaluation is deterministic.

Weights: ``<out>/<task>/policy.pt`` (state dict) and ``meta.json`` (levels, training stats).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmserve.baselines import HeuristicAgent
from llmserve.episode import Episode
from llmserve.models import ServeAction, ServeObservation
from llmserve.profiles import QuantTier
from llmserve.tasks import TASKS, get_task

DEFAULT_OUT = Path(os.environ.get("LLMSERVE_PPO_DIR", Path.home() / ".cache" / "primerl" / "llmserve" / "ppo"))
TRAIN_SEED_BASE = 100_000  # training/validation seeds: TRAIN_SEED_BASE + i; benchmarks use seeds below it
TASK_IDS = list(TASKS)
LEVELS: dict[str, list[Any]] = {
    "batch_cap": [8, 16, 24, 32, 48, 64, 96, 128, 256],
    "kv_budget_fraction": [0.5, 0.7, 0.8, 0.9, 1.0],
    "speculation_depth": [0, 1, 2, 3, 4],
    "quantization_tier": [QuantTier.FP16, QuantTier.INT8, QuantTier.INT4],
    "prefill_decode_split": [False, True],
    "priority_routing": [False, True],
}
HEADS = list(LEVELS)
SIZES = [len(LEVELS[h]) for h in HEADS]
N_FEATURES = 17 + len(TASK_IDS)


def features(obs: ServeObservation) -> list[float]:
    spec = get_task(obs.task_id)
    lg = math.log1p
    return [
        lg(obs.queue_depth) / 5,
        lg(obs.active_requests) / 5,
        obs.kv_cache_occupancy,
        obs.mean_prompt_length / 1000,
        lg(obs.p50_ttft_ms) / 8,
        lg(obs.p99_ttft_ms) / 8,
        lg(obs.p50_itl_ms) / 5,
        obs.throughput_tps / spec.ref_tps,
        obs.slo_compliance_rate,
        obs.gpu_memory_used_gb / spec.hardware.memory_gib,
        lg(obs.estimated_cost_per_1k),
        obs.request_arrival_rate / 10,
        obs.spec_acceptance_rate,
        lg(obs.eviction_events) / 3,
        obs.step_index / spec.episode_length,
        float(obs.active_requests >= 32),  # the heuristic's thresholds, easier to imitate as inputs
        lg(obs.queue_depth + obs.active_requests) / 5,
        *[float(obs.task_id == t) for t in TASK_IDS],
    ]


def to_action(idx: list[int]) -> ServeAction:
    return ServeAction(**{h: LEVELS[h][i] for h, i in zip(HEADS, idx, strict=True)})


def from_action(action: ServeAction) -> list[int]:
    """The nearest level of each field: the discretised heuristic BC imitates."""
    out: list[int] = []
    for h in HEADS:
        value = getattr(action, h)
        levels = LEVELS[h]
        if isinstance(value, int | float) and not isinstance(value, bool):
            dist = [abs(float(level) - value) for level in levels]
            out.append(dist.index(min(dist)))  # ties: the lower level
        else:
            out.append(levels.index(value))
    return out


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, sum(SIZES))
        self.v = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        h = self.body(x)
        return list(torch.split(self.pi(h), SIZES, dim=-1)), self.v(h).squeeze(-1)

    def greedy(self, obs: ServeObservation) -> list[int]:
        with torch.no_grad():
            logits, _ = self(torch.tensor([features(obs)], dtype=torch.float32))
        return [int(lg.argmax(-1)) for lg in logits]


class PPOAgent:
    """The ``Agent`` protocol: greedy (argmax per head) action of the task's trained policy."""

    name = "ppo"

    def __init__(self, weights: Path | str | None = None) -> None:
        self.root = Path(weights) if weights else DEFAULT_OUT
        self._nets: dict[str, ActorCritic] = {}

    def _net(self, task_id: str) -> ActorCritic:
        if task_id not in self._nets:
            path = self.root / task_id / "policy.pt"
            if not path.is_file():
                raise FileNotFoundError(
                    f"no PPO weights for {task_id!r} at {path}; train them: primerl llmserve train --task {task_id}"
                )
            self._nets[task_id] = load_policy(path.parent)
        return self._nets[task_id]

    def act(self, obs: ServeObservation) -> ServeAction:
        return to_action(self._net(obs.task_id).greedy(obs))


def load_policy(directory: Path) -> ActorCritic:
    meta = json.loads((directory / "meta.json").read_text())
    net = ActorCritic(meta["hidden"])
    net.load_state_dict(torch.load(directory / "policy.pt", weights_only=True))
    net.eval()
    return net


@dataclass
class TrainConfig:
    task_id: str
    steps: int = 20_000  # environment steps of the PPO phase (after BC)
    seed: int = 0
    hidden: int = 64
    episodes_per_iter: int = 8
    epochs: int = 4
    minibatch: int = 128
    lr: float = 1e-3
    gamma: float = 0.97
    lam: float = 0.9
    clip: float = 0.2
    entropy: float = 0.003
    bc_episodes: int = 24
    bc_epochs: int = 150
    val_seeds: int = 8
    eval_every: int = 2


@dataclass
class Rollout:
    obs: list[list[float]]
    acts: list[list[int]]
    logp: list[float]
    vals: list[float]
    rews: list[float]
    dones: list[bool]


def _play(act: Callable[[ServeObservation], ServeAction], task_id: str, seed: int) -> float:
    ep = Episode(get_task(task_id), seed)
    obs = ep.initial_observation()
    while not ep.done:
        obs = ep.step(act(obs))
    return ep.total_reward


def greedy_return(net: ActorCritic, task_id: str, seeds: list[int]) -> float:
    return float(np.mean([_play(lambda o: to_action(net.greedy(o)), task_id, s) for s in seeds]))


def _collect(net: ActorCritic, task_id: str, seeds: list[int]) -> Rollout:
    ro = Rollout([], [], [], [], [], [])
    for seed in seeds:
        ep = Episode(get_task(task_id), seed)
        obs = ep.initial_observation()
        while not ep.done:
            x = features(obs)
            with torch.no_grad():
                logits, v = net(torch.tensor([x], dtype=torch.float32))
            dists = [torch.distributions.Categorical(logits=lg[0]) for lg in logits]
            a = [d.sample() for d in dists]
            ro.logp.append(float(sum(d.log_prob(ai) for d, ai in zip(dists, a, strict=True))))
            ro.obs.append(x)
            ro.acts.append([int(ai) for ai in a])
            ro.vals.append(float(v[0]))
            obs = ep.step(to_action(ro.acts[-1]))
            ro.rews.append(float(obs.reward or 0.0))
            ro.dones.append(ep.done)
    return ro


def _gae(ro: Rollout, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    n = len(ro.rews)
    adv = np.zeros(n)
    last = 0.0
    for t in reversed(range(n)):
        nonterminal = 0.0 if ro.dones[t] else 1.0
        next_v = ro.vals[t + 1] if t + 1 < n and not ro.dones[t] else 0.0
        delta = ro.rews[t] + gamma * next_v * nonterminal - ro.vals[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, adv + np.asarray(ro.vals)


def _logp_entropy(net: ActorCritic, x: torch.Tensor, acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits, v = net(x)
    logp = torch.zeros(len(x))
    ent = torch.zeros(len(x))
    for i, lg in enumerate(logits):
        d = torch.distributions.Categorical(logits=lg)
        logp = logp + d.log_prob(acts[:, i])
        ent = ent + d.entropy()
    return logp, ent, v


def _update(net: ActorCritic, opt: torch.optim.Optimizer, ro: Rollout, cfg: TrainConfig, g: torch.Generator) -> None:
    adv_np, ret_np = _gae(ro, cfg.gamma, cfg.lam)
    x = torch.tensor(ro.obs, dtype=torch.float32)
    acts = torch.tensor(ro.acts)
    old = torch.tensor(ro.logp)
    adv = torch.tensor((adv_np - adv_np.mean()) / (adv_np.std() + 1e-8), dtype=torch.float32)
    ret = torch.tensor(ret_np, dtype=torch.float32)
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(x), generator=g)
        for start in range(0, len(x), cfg.minibatch):
            b = perm[start : start + cfg.minibatch]
            logp, ent, v = _logp_entropy(net, x[b], acts[b])
            ratio = torch.exp(logp - old[b])
            surr = torch.min(ratio * adv[b], torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv[b])
            loss = -surr.mean() + 0.5 * ((v - ret[b]) ** 2).mean() - cfg.entropy * ent.mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()


def _discounted(rews: list[float], gamma: float) -> list[float]:
    out = [0.0] * len(rews)
    acc = 0.0
    for t in reversed(range(len(rews))):
        acc = rews[t] + gamma * acc
        out[t] = acc
    return out


def behaviour_clone(net: ActorCritic, cfg: TrainConfig, g: torch.Generator) -> float:
    """Fit the heuristic's discretised actions (and its discounted returns for the critic); returns the
    final per-head accuracy on its states."""
    heuristic = HeuristicAgent()
    xs: list[list[float]] = []
    ys: list[list[int]] = []
    rets: list[float] = []
    for i in range(cfg.bc_episodes):
        ep = Episode(get_task(cfg.task_id), TRAIN_SEED_BASE + 10_000 + i)
        obs = ep.initial_observation()
        rews: list[float] = []
        while not ep.done:
            action = heuristic.act(obs)
            xs.append(features(obs))
            ys.append(from_action(action))
            obs = ep.step(action)
            rews.append(float(obs.reward or 0.0))
        rets += _discounted(rews, cfg.gamma)
    x = torch.tensor(xs, dtype=torch.float32)
    y = torch.tensor(ys)
    ret = torch.tensor(rets, dtype=torch.float32)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    ce = nn.CrossEntropyLoss(label_smoothing=0.2)  # keeps some entropy for PPO to explore with
    for _ in range(cfg.bc_epochs):
        perm = torch.randperm(len(x), generator=g)
        for start in range(0, len(x), 256):
            b = perm[start : start + 256]
            logits, v = net(x[b])
            loss = sum(ce(lg, y[b, i]) for i, lg in enumerate(logits)) + 0.5 * ((v - ret[b]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        logits, _ = net(x)
    return float(np.mean([(lg.argmax(-1) == y[:, i]).float().mean() for i, lg in enumerate(logits)]))


def train(cfg: TrainConfig, out: Path | None = None, log: Any = print) -> dict[str, Any]:
    """BC warm start, then PPO for ``cfg.steps`` environment steps; saves the best greedy policy on the
    validation seeds under ``<out>/<task>/``; returns the training stats (also in ``meta.json``)."""
    get_task(cfg.task_id)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    net = ActorCritic(cfg.hidden)
    val = [TRAIN_SEED_BASE + 20_000 + i for i in range(cfg.val_seeds)]
    bc_acc = behaviour_clone(net, cfg, g)
    best = greedy_return(net, cfg.task_id, val)
    best_state = {k: v.clone() for k, v in net.state_dict().items()}
    heuristic = float(np.mean([_play(HeuristicAgent().act, cfg.task_id, s) for s in val]))
    history = [{"iter": 0, "env_steps": 0, "val_return": best}]
    log(f"[{cfg.task_id}] BC accuracy {bc_acc:.3f}; greedy validation return {best:.3f} (heuristic {heuristic:.3f})")
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    steps, it = 0, 0
    while steps < cfg.steps:
        it += 1
        seeds = [TRAIN_SEED_BASE + int(s) for s in rng.integers(0, 10_000, cfg.episodes_per_iter)]
        ro = _collect(net, cfg.task_id, seeds)
        steps += len(ro.rews)
        _update(net, opt, ro, cfg, g)
        if it % cfg.eval_every == 0 or steps >= cfg.steps:
            score = greedy_return(net, cfg.task_id, val)
            history.append({"iter": it, "env_steps": steps, "val_return": score})
            log(f"[{cfg.task_id}] iter {it} steps {steps}: greedy validation return {score:.3f} (best {best:.3f})")
            if score > best:
                best, best_state = score, {k: v.clone() for k, v in net.state_dict().items()}
    stats = {
        "config": asdict(cfg),
        "hidden": cfg.hidden,
        "levels": {h: [str(v) for v in LEVELS[h]] for h in HEADS},
        "bc_accuracy": bc_acc,
        "bc_val_return": history[0]["val_return"],
        "best_val_return": best,
        "heuristic_val_return": heuristic,
        "history": history,
        "train_seconds": time.perf_counter() - t0,
    }
    directory = (out or DEFAULT_OUT) / cfg.task_id
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(best_state, directory / "policy.pt")
    (directory / "meta.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
