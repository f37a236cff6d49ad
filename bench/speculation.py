"""Speculation benchmark (issue 9, AC4): the embedded engine on a tool-call-heavy workload.

For each drafter configuration the same episodes (``bench/spec_workload.py``) are generated one at a
time (no batching, so the ratio is per-episode latency), greedy unless ``--temperature`` says otherwise.
Reported per configuration: target forward passes per generated token (decode only: one prefill per
episode is subtracted), tokens per target step inside tool-call spans (from the drafter's span
tracker; the "off" row uses a track-only drafter that never drafts), draft acceptance, and wall time.
The figures come from one run, configurations interleaved episode by episode so that machine noise
hits them alike.

    .venv/bin/python -m bench.speculation --episodes 20 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from bench import spec_workload as workload
from bench._common import record
from core.toolcall import TOOL_CALL_BEGIN
from core.types import GenerateRequest, SamplingParams
from engines.config import EmbeddedConfig
from speculation.config import SpeculationConfig
from speculation.drafters import SpeculativeDrafter
from speculation.grammar import CompiledToolGrammar, ll_tokenizer

CONFIGS: dict[str, tuple[str, ...] | None] = {
    "off": None,
    "ngram": ("ngram",),
    "grammar": ("grammar",),
    "grammar+ngram": ("grammar", "ngram"),
}


@dataclass
class Tally:
    seconds: float = 0.0
    tool_seconds: float = 0.0
    tokens: int = 0
    tool_tokens: int = 0
    forwards: int = 0
    tool_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    span_tokens: int = 0
    span_steps: int = 0
    outputs: list[list[int]] = field(default_factory=list)


async def run_episode(
    engine: Any, prompt: list[int], drafter: SpeculativeDrafter, params: SamplingParams
) -> tuple[list[int], float, int]:
    f0 = engine.counters.forward_passes
    t0 = time.perf_counter()
    ids: list[int] = []
    async for chunk in engine.generate(GenerateRequest(f"b{id(drafter)}", tuple(prompt), params, drafter=drafter)):
        ids.extend(chunk.token_ids)
    return ids, time.perf_counter() - t0, engine.counters.forward_passes - f0 - 1  # minus the prefill


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    from engines.embedded.engine import EmbeddedEngine

    engine = await EmbeddedEngine.start(EmbeddedConfig(max_model_len=2048, num_threads=args.threads))
    compiled = CompiledToolGrammar(workload.grammar(), ll_tokenizer(engine.tokenizer._tok))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=0 if args.temperature else None
    )
    prompts = [
        engine.tokenizer.render_prompt(list(e.messages), list(e.tool_schemas)) for e in workload.episodes(args.episodes)
    ]
    tallies = {name: Tally() for name in CONFIGS}
    await run_episode(
        engine, prompts[0], SpeculativeDrafter(SpeculationConfig(drafters=()), compiled), params
    )  # warm-up
    for prompt in prompts:
        for name, drafters in CONFIGS.items():
            cfg = SpeculationConfig(enabled=True, drafters=drafters or (), max_draft_tokens=args.max_draft)
            drafter = SpeculativeDrafter(cfg, compiled)  # "off": tracks spans, never drafts
            ids, secs, forwards = await run_episode(engine, prompt, drafter, params)
            drafter.draft([*prompt, *ids], 0)  # let the tracker see the last token
            t = tallies[name]
            t.outputs.append(ids)
            t.seconds += secs
            t.tokens += len(ids)
            t.forwards += forwards
            tool = TOOL_CALL_BEGIN in engine.tokenizer.decode(ids)
            if tool:
                t.tool_seconds += secs
                t.tool_tokens += len(ids)
                t.tool_forwards += forwards
            t.drafted += sum(drafter.stats.drafted.values())
            t.accepted += sum(drafter.stats.accepted.values())
            t.span_tokens += drafter.stats.span_tokens
            t.span_steps += drafter.stats.span_steps
    await engine.close()

    off = tallies["off"]
    tool_eps = sum(TOOL_CALL_BEGIN in engine.tokenizer.decode(o) for o in off.outputs)
    rows: list[tuple[str, str, str]] = [
        ("episodes (with a tool call)", f"{args.episodes} ({tool_eps})", ""),
        ("temperature / max tokens / max draft", f"{args.temperature} / {args.max_tokens} / {args.max_draft}", ""),
    ]
    figures: dict[str, Any] = {"episodes": args.episodes, "tool_episodes": tool_eps}
    print(
        f"{'config':>14} {'tok/fwd':>8} {'span tok/step':>13} {'accept':>7} {'wall s':>7} {'tool-ep x':>9} {'same':>5}"
    )
    for name, t in tallies.items():
        tpf = t.tokens / max(1, t.forwards)
        span = t.span_tokens / max(1, t.span_steps)
        acc = t.accepted / max(1, t.drafted)
        speed = off.tool_seconds / t.tool_seconds if t.tool_seconds else float("nan")
        same = sum(a == b for a, b in zip(t.outputs, off.outputs, strict=True))
        print(f"{name:>14} {tpf:8.2f} {span:13.2f} {acc:7.2f} {t.seconds:7.1f} {speed:9.2f} {same:>5}")
        rows.append(
            (
                name,
                f"{tpf:.2f} tok/fwd; in spans {span:.2f} tok/step; accept {acc:.2f}; "
                f"tool episodes {t.tool_seconds:.1f} s ({speed:.2f}x); identical outputs {same}/{args.episodes}",
                ">= 1.5x tok/fwd in spans, >= 1.2x e2e" if name != "off" else "baseline",
            )
        )
        figures[name] = {
            "tokens_per_forward": tpf,
            "span_tokens_per_step": span,
            "acceptance": acc,
            "seconds": t.seconds,
            "tool_episode_seconds": t.tool_seconds,
            "tool_episode_speedup": speed,
            "identical_outputs": same,
        }
    if not args.no_record:
        off_tpf = off.tokens / max(1, off.forwards)
        ratios = {}
        for name, f in figures.items():
            if isinstance(f, dict) and name != "off":
                ratios[f"{name}_tokens_per_forward_gain"] = f["tokens_per_forward"] / off_tpf
                ratios[f"{name}_span_tokens_per_step"] = f["span_tokens_per_step"]
                ratios[f"{name}_tool_episode_speedup"] = f["tool_episode_speedup"]
        record(
            "speculation",
            "Speculation on tool calls (embedded SmolLM2-135M, CPU)",
            rows,
            figures,
            f"{args.episodes} episodes from bench/spec_workload.py, each run with every configuration in turn "
            "(interleaved); the engine in-process, one episode at a time.",
            ratios=ratios,
        )


if __name__ == "__main__":
    asyncio.run(main())
