"""Run the fleet simulator's experiments, print one table per workload, append them to bench/RESULTS.md.

    .venv/bin/python -m bench.fleet_sim            # full scale (8 replicas; ~10 min on 2 busy cores)
    .venv/bin/python -m bench.fleet_sim --quick    # small scale (4 replicas; ~1 min)

The plot (hit ratio and throughput vs offered load) goes to bench/plots/fleet_sim.png.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench._common import record
from bench.fleet_sim import experiments as ex
from bench.fleet_sim.sim import Result

PLOT = Path(__file__).resolve().parent.parent / "plots" / "fleet_sim.png"


def fmt(r: Result) -> str:
    return (
        f"{r.throughput:,.0f} tok/s, hit {r.hit_ratio:.3f}, "
        f"recomputed {r.recomputed / max(1, r.turns) / 1e3:.2f} k/turn, "
        f"TTFT p50/p99 {r.ttft_pct(50):.2f}/{r.ttft_pct(99):.2f} s, CoV {r.load_cov:.3f}, "
        f"index {r.extra.get('index_bytes', 0) / 2**20:.1f} MiB, {r.index_ops_per_turn:.1f} ops/turn"
    )


def table(title: str, rows: list[tuple[str, str, str]]) -> None:
    print(f"\n== {title}")
    for a, b, c in rows:
        print(f"  {a:32s} {b}   {c}")


def plot(sweep: dict[str, list[tuple[int, Result]]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p, pts in sweep.items():
        xs = [c for c, _ in pts]
        a1.plot(xs, [r.hit_ratio for _, r in pts], marker="o", label=p)
        a2.plot(xs, [r.throughput / 1e3 for _, r in pts], marker="o", label=p)
    a1.set(xlabel="concurrent agent episodes", ylabel="prefix hit ratio (tokens)", title="Hit ratio vs load")
    a2.set(xlabel="concurrent agent episodes", ylabel="output k tokens/s", title="Throughput vs load")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small scale (4 replicas)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = ap.parse_args()
    s = ex.SMALL if args.quick else ex.FULL
    t0 = time.time()
    figures: dict[str, Any] = {}
    rows: list[tuple[str, str, str]] = []

    ag = ex.agentic(s)
    rr, ca, orc = ag["round_robin"], ag["cache_aware"], ag["oracle"]
    for p, r in ag.items():
        rows.append((f"agentic: {p}", fmt(r), ""))
        figures[f"agentic.{p}"] = {"throughput": r.throughput, "hit": r.hit_ratio, "cov": r.load_cov}
    rows.append(("agentic: cache_aware / round_robin throughput", f"{ca.throughput / rr.throughput:.2f}x", ">= 2x"))
    rows.append(("agentic: cache_aware / oracle hit ratio", f"{ca.hit_ratio / orc.hit_ratio:.3f}", ">= 0.9"))
    rows.append(("agentic: cache_aware load CoV", f"{ca.load_cov:.3f}", "<= 0.1"))
    table("agentic", rows[-len(ag) - 3 :])

    for G in (8, 16, 64):
        gr = ex.grpo(s, G, ("round_robin", "least_loaded", "consistent_hash", "cache_aware", "oracle"))
        part = [
            (f"grpo G={G}: {p}", f"{fmt(r)}, prompt prefills/group {pf:.2f} ({full:.2f} in full blocks)", "")
            for p, (r, pf, full) in gr.items()
        ]
        ca_g = gr["cache_aware"]
        part.append(
            (f"grpo G={G}: cache_aware prompt prefills/group", f"{ca_g[1]:.2f} ({ca_g[2]:.2f} full blocks)", "~1")
        )
        figures[f"grpo{G}"] = {
            p: {"throughput": r.throughput, "prefills_per_group": pf, "full_block_prefills": full}
            for p, (r, pf, full) in gr.items()
        }
        rows += part
        table(f"grpo G={G}", part)

    sp = ex.sysprompt(s, ("round_robin", "least_loaded", "prefix_hash", "cache_aware", "oracle"))
    part = [(f"sysprompt zipf: {p}", fmt(r), "") for p, r in sp.items()]
    part.append(
        (
            "sysprompt: cache_aware / round_robin tput",
            f"{sp['cache_aware'].throughput / sp['round_robin'].throughput:.2f}x",
            "",
        )
    )
    rows += part
    table("system prompts (Zipf 1.2, 256 prefixes of 2-8k)", part)

    br = ex.bridges(s)
    part = [(f"bridges: {k}", fmt(r), "") for k, r in br.items()]
    hits = [r.hit_ratio / br["oracle"].hit_ratio for k, r in br.items() if k != "oracle"]
    part.append(("bridges: hit / oracle, 1->8 bridges", " / ".join(f"{h:.3f}" for h in hits), ">= 0.9, flat"))
    figures["bridges"] = {
        k: {"hit": r.hit_ratio, "cov": r.load_cov, "ops": r.index_ops_per_turn} for k, r in br.items()
    }
    rows += part
    table("1-8 bridges sharing the index", part)

    ev = ex.eviction(s)
    part = []
    for mode, (r, sp_tok, sp_rec) in ev.items():
        part.append(
            (
                f"eviction {mode} (index = 0.1 x KV)",
                f"{fmt(r)}; shared-prefix recomputed {sp_rec / 1e6:.3f} M of {sp_tok / 1e6:.2f} M",
                "",
            )
        )
    (rc, _, c_rec), (rl, _, l_rec) = ev["cost"], ev["lru"]
    part.append(("eviction: cost / lru, all recomputed", f"{rc.recomputed / rl.recomputed:.3f}", "< 1"))
    part.append(("eviction: cost / lru, shared-prefix recomputed", f"{c_rec / max(1, l_rec):.3f}", "< 1"))
    figures["eviction"] = {
        "cost_recomputed": rc.recomputed,
        "lru_recomputed": rl.recomputed,
        "cost_shared": c_rec,
        "lru_shared": l_rec,
    }
    rows += part
    table("index eviction: cost-aware vs LRU", part)

    sk = ex.skew(s)
    part = []
    for k, r in sk.items():
        hot = r.extra.get("hot_replica_hit_ratio", math.nan)
        share = r.extra.get("hot_replica_share", math.nan)
        part.append((f"skew: {k}", f"{fmt(r)}, hottest replica: hit {hot:.3f}, {share:.0%} of prompt tokens", ""))
    ph, ca_sk = sk["prefix_hash zipf=1.5"], sk["cache_aware zipf=1.5"]
    part.append(
        (
            "skew: prefix_hash / cache_aware tput (zipf 1.5)",
            f"{ph.throughput / ca_sk.throughput:.2f}",
            "hot-spot collapse",
        )
    )
    rows += part
    table("consistent hashing under skew (sanity check)", part)

    fa = ex.faults(s)
    part = [(f"faults: {p}", fmt(r), "") for p, r in fa.items()]
    rows += part
    table("replica restart at 40%, scale-out x1.5 at 70%", part)

    levels = tuple(int(s.concurrency * f) for f in (0.125, 0.25, 0.5, 0.75, 1.0, 1.25))
    sweep = ex.load_sweep(s, levels, ("round_robin", "least_loaded", "consistent_hash", "cache_aware", "oracle"))
    plot(sweep, PLOT)
    figures["sweep"] = {p: [(c, r.hit_ratio, r.throughput) for c, r in pts] for p, pts in sweep.items()}
    print(f"\nplot: {PLOT}  ({time.time() - t0:.0f} s)")

    if not args.no_record:
        scale = "quick (4 replicas)" if args.quick else "full (8 replicas)"
        record(
            "fleet_sim",
            f"Fleet simulator: routing policies, {scale}, seed {s.seed}",
            rows,
            figures,
            notes=(
                "Simulated (bench/fleet_sim): engine-true LRU KV per replica, chunked-prefill step model "
                "(20k prefill tok/s, 4 ms + 0.12 ms/seq decode steps), blocks of 64 tokens, KV 400k tokens per replica "
                "(200k for system prompts). Throughput = output tokens/s after warm-up; hit = cached/prompt tokens; "
                "CoV = across replicas of the time-averaged in-flight tokens; index bytes = entries x 24 B notional "
                "(real Redis: see the cache_index rows). Multi-bridge runs pick a random bridge per turn and share "
                "load through a 20 ms load board.\n\n"
                f"![hit ratio and throughput vs load]({PLOT.relative_to(PLOT.parent.parent).as_posix()})"
            ),
            ratios={
                "agentic_cache_aware_over_round_robin_tput": ca.throughput / rr.throughput,
                "agentic_cache_aware_hit_over_oracle": ca.hit_ratio / orc.hit_ratio,
                "agentic_cache_aware_load_cov": ca.load_cov,
                "grpo8_cache_aware_prompt_prefills_per_group": figures["grpo8"]["cache_aware"]["prefills_per_group"],
                "bridges8_hit_over_oracle": hits[-1],
                "eviction_cost_over_lru_recomputed": rc.recomputed / rl.recomputed,
                "skew_prefix_hash_over_cache_aware_tput": ph.throughput / ca_sk.throughput,
            },
            plots=(PLOT.relative_to(PLOT.parent.parent).as_posix(),),
        )


if __name__ == "__main__":
    main()
