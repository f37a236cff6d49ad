"""The simulator's experiments, each a function of a scale so tests can run small seeded versions.

Every function returns plain rows (policy -> figures) that __main__ prints, records and plots.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.fleet_sim.engine import EngineSpec
from bench.fleet_sim.sim import Fleet, Result
from bench.fleet_sim.workloads import AgentWorkload, Faults, GrpoWorkload, SysPromptWorkload


@dataclass(frozen=True)
class Scale:
    replicas: int = 8
    concurrency: int = 512  # agent episodes in flight (saturating for 8 replicas)
    duration: float = 150.0
    warmup: float = 30.0
    grpo_samples: int = 1024  # per RL step
    grpo_steps: int = 3
    sys_rate: float = 70.0
    seed: int = 1


FULL = Scale()
SMALL = Scale(replicas=4, concurrency=192, duration=50.0, warmup=15.0, grpo_samples=256, grpo_steps=2, sys_rate=35.0)

AGENT_POLICIES = ("round_robin", "least_loaded", "sticky", "consistent_hash", "prefix_hash", "cache_aware", "oracle")


def agentic(s: Scale, policies: tuple[str, ...] = AGENT_POLICIES, concurrency: int | None = None) -> dict[str, Result]:
    out = {}
    for p in policies:
        f = Fleet(p, replicas=s.replicas, seed=s.seed)
        out[p] = f.run(AgentWorkload(concurrency=concurrency or s.concurrency), until=s.duration, warmup=s.warmup)
    return out


def grpo(s: Scale, G: int, policies: tuple[str, ...]) -> dict[str, tuple[Result, float, float]]:
    """Per policy: (result, mean prompt prefills per group, same without partial last blocks); 1.0 = once."""
    out = {}
    for p in policies:
        w = GrpoWorkload(G=G, groups=max(1, s.grpo_samples // G), steps=s.grpo_steps)
        f = Fleet(p, replicas=s.replicas, seed=s.seed + G)
        res = f.run(w, until=3600.0)
        full = statistics.fmean(w.group_prefill_full) if w.group_prefill_full else float("nan")
        out[p] = (res, statistics.fmean(w.group_prefill) if w.group_prefill else float("nan"), full)
    return out


def sysprompt(s: Scale, policies: tuple[str, ...]) -> dict[str, Result]:
    out = {}
    for p in policies:
        f = Fleet(p, replicas=s.replicas, seed=s.seed + 7, spec=EngineSpec(kv_tokens=200_000))
        out[p] = f.run(SysPromptWorkload(rate=s.sys_rate), until=s.duration * 0.6, warmup=s.warmup * 0.6)
    return out


def bridges(s: Scale, counts: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Result]:
    """cache_aware with 1..8 bridges sharing the index (random bridge per turn), and the oracle."""
    conc = s.concurrency * 3 // 4
    out = {}
    for b in counts:
        f = Fleet("cache_aware", replicas=s.replicas, bridges=b, seed=s.seed + 11)
        out[f"cache_aware x{b}"] = f.run(AgentWorkload(concurrency=conc), until=s.duration, warmup=s.warmup)
    f = Fleet("oracle", replicas=s.replicas, seed=s.seed + 11)
    out["oracle"] = f.run(AgentWorkload(concurrency=conc), until=s.duration, warmup=s.warmup)
    return out


def eviction(s: Scale, ratio: float = 0.1) -> dict[str, tuple[Result, int, int]]:
    """Index bounded below KV (ratio), popular prefixes + periodic one-off scans: cost vs LRU index eviction.

    Per mode: (result, prompt tokens of shared-prefix requests, of which recomputed).
    """
    out = {}
    for mode in ("cost", "lru"):
        f = Fleet(
            "cache_aware", replicas=s.replicas, seed=s.seed + 13, eviction=mode, index_capacity_ratio=ratio,
            spec=EngineSpec(kv_tokens=400_000),
        )  # fmt: skip
        w = SysPromptWorkload(
            rate=15 * s.replicas / 8, k=64, zipf=1.0, suffix=(50, 200), scan_period_s=8, scan_s=2,
            scan_rate=30 * s.replicas / 8, oneoff_tokens=(4000, 8000),
        )  # fmt: skip
        res = f.run(w, until=s.duration * 0.6, warmup=s.warmup * 0.6)
        out[mode] = (res, w.shared_prompt, w.shared_recomputed)
    return out


def skew(s: Scale) -> dict[str, Result]:
    """Consistent hashing on the prefix (SGLang prefix_hash) under uniform vs Zipf-skewed system prompts."""
    out = {}
    conc = s.concurrency * 3 // 4
    for z in (0.0, 1.5):
        for p in ("prefix_hash", "cache_aware"):
            f = Fleet(p, replicas=s.replicas, seed=s.seed + 17)
            out[f"{p} zipf={z}"] = f.run(AgentWorkload(concurrency=conc, zipf=z), until=s.duration, warmup=s.warmup)
    return out


def faults(s: Scale, policies: tuple[str, ...] = ("round_robin", "consistent_hash", "cache_aware", "oracle")) -> dict:
    """Agentic load; replica 0 restarts (KV lost) at 40% of the run, scale-out by half at 70%."""
    out = {}
    conc = s.concurrency // 2
    for p in policies:
        f = Fleet(p, replicas=s.replicas, seed=s.seed + 19)
        Faults(restart_at=s.duration * 0.4, scale_out_at=s.duration * 0.7, scale_out_to=s.replicas * 3 // 2).install(f)
        out[p] = f.run(AgentWorkload(concurrency=conc), until=s.duration, warmup=s.warmup)
    return out


def load_sweep(s: Scale, levels: tuple[int, ...], policies: tuple[str, ...]) -> dict[str, list[tuple[int, Result]]]:
    out: dict[str, list[tuple[int, Result]]] = {p: [] for p in policies}
    for c in levels:
        for p, r in agentic(s, policies, concurrency=c).items():
            out[p].append((c, r))
    return out
