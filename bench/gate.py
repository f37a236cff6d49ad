"""Performance gate: compare figures against committed baselines (``bench/baselines.json``) and fail on regressions.

Two sources of figures:

* ``--fast`` (run by ``make test``): deterministic, count-based probes that take well under a minute and do not
  depend on how busy the machine is: prefill tokens the embedded engine computes on turn 5 of an episode
  (stateful decode), prompt prefills of a GRPO group of 8, forward passes to decode 8 concurrent episodes
  (batching), and the seeded results other benchmarks expose as ``fast_figures()``.
* default (``make bench-gate``): the JSON each benchmark wrote to ``bench/out/`` in the last ``make bench``.

Each baseline names a figure, its value, the direction that is better and a tolerance; a figure worse than
``baseline -/+ tolerance`` fails the gate with a table of what regressed and by how much.
``--inject kv-off|no-batching|no-group-sharing`` deliberately breaks the engine to show the gate catches it.

Usage: python bench/gate.py [--fast] [--inject NAME] [--write-baselines]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH = Path(__file__).resolve().parent
BASELINES = BENCH / "baselines.json"
INJECTIONS = ("kv-off", "no-batching", "no-group-sharing")


@dataclass(frozen=True)
class Verdict:
    figure: str
    value: float | None
    baseline: float
    better: str
    tolerance: float
    ok: bool

    @property
    def delta(self) -> str:
        if self.value is None:
            return "missing"
        return f"{self.value - self.baseline:+.4g}"


def check(figures: dict[str, float], baselines: dict[str, Any]) -> list[Verdict]:
    out = []
    for name, spec in sorted(baselines.items()):
        value = figures.get(name)
        base, tol, better = float(spec["value"]), float(spec["tolerance"]), spec["better"]
        if value is None:
            ok = False
        elif better == "higher":
            ok = value >= base - tol
        elif better == "lower":
            ok = value <= base + tol
        else:
            raise ValueError(f"{name}: 'better' must be 'higher' or 'lower', got {better!r}")
        out.append(Verdict(name, value, base, better, tol, ok))
    return out


def table(verdicts: list[Verdict]) -> str:
    rows = [("figure", "value", "baseline", "better", "tolerance", "change", "")]
    for v in verdicts:
        value = "—" if v.value is None else f"{v.value:.4g}"
        rows.append(
            (
                v.figure,
                value,
                f"{v.baseline:.4g}",
                v.better,
                f"{v.tolerance:.4g}",
                v.delta,
                "ok" if v.ok else "REGRESSED",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


# -- fast, deterministic probes ------------------------------------------------------------------------


async def embedded_probes(inject: str | None) -> dict[str, float]:
    """Count-based figures of the embedded engine (greedy decoding, token and forward-pass counters)."""
    from engines.config import EmbeddedConfig
    from engines.embedded import EmbeddedEngine
    from engines.types import GenerateRequest, Message, SamplingParams

    config = EmbeddedConfig(kv_budget_bytes=0 if inject == "kv-off" else 1 << 30)
    if inject == "no-batching":
        config = config.model_copy(update={"max_batch_size": 1})
    engine = await EmbeddedEngine.start(config)
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(ids: list[int], episode: str = "", group: str = "", params: SamplingParams = greedy) -> list[int]:
        out: list[int] = []
        request = GenerateRequest(uuid.uuid4().hex, tuple(ids), params, episode, group, "gate@0")
        async for chunk in engine.generate(request):
            out.extend(chunk.token_ids)
        return out

    try:
        figures: dict[str, float] = {}
        # Stateful decode: share of the history prefilled on turn 5 (1.0 = everything recomputed).
        ids = tok.render_prompt([Message("user", "List five fruits, one per turn.")])
        for turn in range(5):
            if turn:
                ids += tok.render_continuation([Message("user", f"Next one, number {turn + 1}. " * 4)], ids)
            before = engine.counters.prefill_tokens
            ids += await run(ids, episode="gate-ep")
        figures["embedded.turn5_prefill_share"] = (engine.counters.prefill_tokens - before) / (len(ids) - 8)
        await engine.release("gate-ep")

        # GRPO group of 8: prompt prefills per group (1.0 = shared once).
        prompt = tok.render_prompt([Message("user", "Pick a number.")])
        before = engine.counters.prefill_tokens
        group = "gate-grp" if inject != "no-group-sharing" else ""
        await asyncio.gather(*(run(prompt, episode=f"gate-g{i}", group=group) for i in range(8)))
        figures["embedded.group8_prompt_prefills"] = (engine.counters.prefill_tokens - before) / len(prompt)
        for i in range(8):
            await engine.release(f"gate-g{i}")

        # Batching: decode forward passes per generated token of 8 concurrent episodes (1/8 = fully batched).
        sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=0)
        prompts = [tok.render_prompt([Message("user", f"Story {i}.")]) for i in range(8)]
        forwards, generated = engine.counters.forward_passes, engine.counters.generated_tokens
        await asyncio.gather(*(run(p, params=sampled) for p in prompts))
        decode_forwards = engine.counters.forward_passes - forwards - 8  # minus the 8 prefills
        figures["embedded.batch8_forwards_per_token"] = decode_forwards / (engine.counters.generated_tokens - generated)
        return figures
    finally:
        await engine.close()


def fast_figures(inject: str | None) -> dict[str, float]:
    figures = asyncio.run(embedded_probes(inject))
    # Seeded figures other benchmarks expose cheaply (imported lazily; absent modules are skipped).
    for module in ("bench.fleet_sim.gate", "bench.speculation_gate"):
        try:
            mod = __import__(module, fromlist=["fast_figures"])
        except ModuleNotFoundError:
            continue
        figures.update(mod.fast_figures())
    return figures


def recorded_figures() -> dict[str, float]:
    """Figures from the JSON written by the last full benchmark run, as ``<benchmark>.<figure>``."""
    figures: dict[str, float] = {}
    for path in sorted((BENCH / "out").glob("*.json")):
        payload = json.loads(path.read_text())
        for key, value in payload.get("figures", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                figures[f"{payload['benchmark']}.{key}"] = float(value)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="run the deterministic probes (what make test runs)")
    parser.add_argument("--inject", choices=INJECTIONS, help="deliberately break the engine (to test the gate)")
    parser.add_argument("--write-baselines", action="store_true", help="print the measured figures as JSON")
    args = parser.parse_args()

    figures = fast_figures(args.inject) if args.fast else recorded_figures()
    if args.write_baselines:
        print(json.dumps({k: round(v, 6) for k, v in sorted(figures.items())}, indent=2))
        return 0
    baselines = json.loads(BASELINES.read_text())
    section = baselines["fast" if args.fast else "full"]
    verdicts = check(figures, section)
    print(table(verdicts))
    failed = [v for v in verdicts if not v.ok]
    if failed:
        names = ", ".join(v.figure for v in failed)
        print(f"\nperformance gate FAILED: {len(failed)} figure(s) regressed: {names}", file=sys.stderr)
        return 1
    print(f"\nperformance gate passed ({len(verdicts)} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
