"""Embedded engine: stateful decode vs re-prefill, batching, load times, peak RSS (issue 4, figures in RESULTS.md).

All figures come from one process and one run, each compared with its baseline side by side:

* turn-5 latency of a 5-turn agent episode with its KV kept (stateful) vs the same turn after its KV was
  evicted (the engine re-prefills the whole history, as a stateless engine would); turns interleaved;
* decode tokens/s of 8 concurrent episodes vs 1;
* model load cold (GGUF -> fp32 conversion into an empty cache, then load) vs warm (cached);
* peak RSS of the process.

Usage: python bench/embedded_engine.py [--repeats 3] [--skip-cold]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import record
from core.types import GenerateRequest, Message, SamplingParams
from engines.config import EmbeddedConfig
from engines.embedded.engine import EmbeddedEngine


def tool_output(rows: int) -> str:
    """A tool result (SQL rows) of ``rows`` rows, ~21 tokens each."""
    items = (f"id={i}, name=item{i}, price={i * 3 % 17}.{i % 10}0, stock={i * 7 % 23}" for i in range(rows))
    return "Result rows: " + "; ".join(items)


async def run_turn(
    engine: EmbeddedEngine, ids: list[int], params: SamplingParams, episode: str
) -> tuple[list[int], float, float]:
    """Generate one turn; returns (tokens, latency s, time to first token s)."""
    start = time.perf_counter()
    first = 0.0
    out: list[int] = []
    request = GenerateRequest(uuid.uuid4().hex, tuple(ids), params, episode_id=episode, cache_salt="bench@0")
    async for chunk in engine.generate(request):
        if chunk.token_ids and not first:
            first = time.perf_counter() - start
        out.extend(chunk.token_ids)
    return out, time.perf_counter() - start, first


async def stateful_vs_reprefill(engine: EmbeddedEngine, repeats: int, gen_tokens: int, rows: int) -> dict[str, float]:
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    lat = {"stateful": [], "reprefill": []}
    ttft = {"stateful": [], "reprefill": []}
    history_len = 0
    for r in range(repeats):
        for mode in ("stateful", "reprefill"):  # interleaved, so load drift hits both alike
            ep = f"bench-{mode}-{r}"
            ids = tok.render_prompt([Message("user", f"Find the cheapest item in stock (run {r}).")])
            for turn in range(5):
                if turn:
                    obs = [Message("tool", f"{tool_output(rows)} (page {turn})")]
                    ids = ids + tok.render_continuation(obs, ids)
                if turn == 4 and mode == "reprefill":
                    engine.evict(ep)
                out, latency, first = await run_turn(engine, ids, params, ep)
                ids = ids + out
            lat[mode].append(latency)
            ttft[mode].append(first)
            history_len = len(ids) - gen_tokens
            await engine.release(ep)
    s, p = statistics.median(lat["stateful"]), statistics.median(lat["reprefill"])
    fs, fp = statistics.median(ttft["stateful"]), statistics.median(ttft["reprefill"])
    return {
        "observation_tokens": len(tok.encode(tool_output(rows))),
        "turn5_history_tokens": history_len,
        "stateful_s": s,
        "reprefill_s": p,
        "ratio": p / s,
        "stateful_ttft_s": fs,
        "reprefill_ttft_s": fp,
        "ttft_ratio": fp / fs,
    }


async def concurrency(engine: EmbeddedEngine, tokens: int) -> dict[str, float]:
    tok = engine.tokenizer
    prompts = [tok.render_prompt([Message("user", f"Write a long story about robot number {i}.")]) for i in range(8)]

    async def one(i: int) -> int:
        params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=i, ignore_eos=True)
        out, _, _ = await run_turn(engine, prompts[i], params, f"conc-{i}")
        await engine.release(f"conc-{i}")
        return len(out)

    await one(0)  # warm-up
    start = time.perf_counter()
    n1 = await one(1)
    solo = n1 / (time.perf_counter() - start)
    start = time.perf_counter()
    n8 = sum(await asyncio.gather(*(one(i) for i in range(8))))
    eight = n8 / (time.perf_counter() - start)
    return {"tokens_per_s_1": solo, "tokens_per_s_8": eight, "ratio": eight / solo}


def plot_turn5(rows: list[int], workloads: list[dict[str, float]], conc: dict[str, float]) -> str:
    """Bars: turn-5 latency stateful vs re-prefill per workload, and decode tokens/s 1 vs 8 episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(__file__).resolve().parent / "plots" / "embedded_engine.png"
    path.parent.mkdir(exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = range(len(workloads))
    a1.bar([x - 0.2 for x in xs], [w["stateful_s"] * 1e3 for w in workloads], 0.4, label="stateful (KV kept)")
    a1.bar([x + 0.2 for x in xs], [w["reprefill_s"] * 1e3 for w in workloads], 0.4, label="re-prefill history")
    a1.set_xticks(list(xs), [f"{w['turn5_history_tokens']:.0f}-token history" for w in workloads])
    a1.set(ylabel="turn-5 latency (ms)", title="Turn 5: stateful vs re-prefill")
    a1.legend(fontsize=8)
    a2.bar(["1 episode", "8 concurrent"], [conc["tokens_per_s_1"], conc["tokens_per_s_8"]], color="tab:green")
    a2.set(ylabel="decode tokens/s", title=f"Batching: {conc['ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.relative_to(path.parent.parent).as_posix()


def load_times(skip_cold: bool) -> dict[str, float]:
    from engines.embedded.engine import load_model

    out: dict[str, float] = {}
    if not skip_cold:
        with tempfile.TemporaryDirectory(prefix="primerl-bench-cache-") as tmp:
            start = time.perf_counter()
            load_model(EmbeddedConfig(model_cache=str(Path(tmp))), "")
            out["cold_s"] = time.perf_counter() - start
    start = time.perf_counter()
    load_model(EmbeddedConfig(), "")
    out["warm_s"] = time.perf_counter() - start
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="episodes per mode for the turn-5 comparison")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[8, 20, 40], help="tool-output rows per observation, one workload each"
    )
    parser.add_argument("--gen-tokens", type=int, default=24, help="tokens generated per turn")
    parser.add_argument("--concurrent-tokens", type=int, default=48, help="tokens per episode in the batching run")
    parser.add_argument("--skip-cold", action="store_true", help="skip the cold conversion (~30-50 s)")
    args = parser.parse_args()

    print("loading ...", flush=True)
    loads = load_times(args.skip_cold)
    engine = await EmbeddedEngine.start(EmbeddedConfig())
    try:
        print("turn-5 latency, stateful vs re-prefill ...", flush=True)
        workloads = [await stateful_vs_reprefill(engine, args.repeats, args.gen_tokens, rows) for rows in args.rows]
        print("1 vs 8 concurrent episodes ...", flush=True)
        conc = await concurrency(engine, args.concurrent_tokens)
    finally:
        await engine.close()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows: list[tuple[str, str, str]] = []
    for st in workloads:
        what = f"{st['observation_tokens']}-token observations, {st['turn5_history_tokens']:.0f}-token history"
        lat = f"{st['stateful_s'] * 1e3:.0f} / {st['reprefill_s'] * 1e3:.0f} ms"
        first = f"{st['stateful_ttft_s'] * 1e3:.0f} / {st['reprefill_ttft_s'] * 1e3:.0f} ms ({st['ttft_ratio']:.1f}x)"
        rows += [
            (f"turn-5 latency stateful / re-prefill ({what})", lat, ""),
            (f"turn-5 speed-up, stateful ({what})", f"{st['ratio']:.2f}x", ">= 2x"),
            (f"turn-5 first token stateful / re-prefill ({what})", first, ""),
        ]
    rows += [
        ("decode tokens/s, 1 episode", f"{conc['tokens_per_s_1']:.1f}", "baseline"),
        ("decode tokens/s, 8 concurrent episodes", f"{conc['tokens_per_s_8']:.1f}", ""),
        ("batching gain, 8 vs 1", f"{conc['ratio']:.2f}x", ">= 3x"),
        (
            "model load, cold (GGUF conversion + load)",
            f"{loads['cold_s']:.1f} s" if "cold_s" in loads else "skipped",
            "",
        ),
        ("model load, warm (cached checkpoint)", f"{loads['warm_s']:.2f} s", ""),
        ("peak RSS of the process", f"{rss_mib:.0f} MiB", ""),
    ]
    notes = (
        f"{args.repeats} episodes per mode and workload, interleaved; {args.gen_tokens} greedy tokens per turn; "
        f"batching: {args.concurrent_tokens} sampled tokens per episode. Engine in-process (no gRPC); torch CPU, fp32."
    )
    record(
        "embedded_engine",
        "Embedded engine (SmolLM2-135M, torch CPU)",
        rows,
        {"turn5": workloads, **conc, **loads, "peak_rss_mib": rss_mib},
        notes,
        ratios={
            **{f"turn5_speedup_rows{r}": st["ratio"] for r, st in zip(args.rows, workloads, strict=True)},
            **{f"turn5_ttft_speedup_rows{r}": st["ttft_ratio"] for r, st in zip(args.rows, workloads, strict=True)},
            "batch8_over_1_tokens_per_s": conc["ratio"],
        },
        plots=(plot_turn5(args.rows, workloads, conc),),
    )


if __name__ == "__main__":
    asyncio.run(main())
