"""Performance gate: each figure against its accepted baseline (``bench/baselines.json``), failing only on a
regression beyond the figure's noise band; targets are a separate report that never fails.

Two sources of figures:

* ``--fast`` (run by ``make test``, ~1 min): deterministic, count-based probes that do not depend on how busy
  the machine is: prefill tokens the embedded engine computes on turn 5 of an episode (stateful decode), prompt
  prefills of a GRPO group of 8, forward passes to decode 8 concurrent episodes (batching), target forward passes
  per token with speculation on vs off (greedy tool calls), and the seeded fleet simulator's ratios (simulated
  time: cache-aware vs round-robin throughput, hit ratio vs the oracle, GRPO prompt prefills per group). Each has
  a ``value`` and an absolute ``tolerance`` ("fast" section).
* default: the figures each benchmark wrote to ``bench/results/<name>.json`` in its last recorded run (``make
  bench`` / ``primerl bench``), against the "full" section. ``--with-fast`` runs the fast probes as well: ``make
  bench-gate`` runs the matrix, then both.

A "full" entry holds the figure's target (``target``, ``better``, ``why``, and ``unmet``: the measured figure and
the reason where this machine cannot meet it) and its accepted ``baseline``: the recorded figure (``value``,
``recorded``) and a noise band (``noise``) measured from the recorded runs in ``runs`` (``noise_from`` names
them): max/min - 1 over the figure's runs since the code or the method behind it last changed, the last 5 at
most, rounded up to a percent and at least ``NOISE_FLOOR`` (seeded and count-based figures repeat exactly); a
figure with one comparable run gets ``NOISE_ONE_RUN``. Only the baseline decides: a figure fails when it is worse
than its baseline by more than a factor 1 + noise, in the direction ``better`` names, so the gate is green on
unchanged code wherever the runs' spread holds, and a target this machine cannot meet does not turn it red. A
figure whose benchmark did not run is reported, and fails only when that benchmark was to run (``--only``,
``--require``: the matrix names what it ran).

``--targets`` (``make bench-targets``) prints every recorded figure against its target: value, target, gap
(absolute and relative) and, for a miss, the documented reason. It reads the recorded results, runs nothing and
always exits 0.

``--inject NAME`` deliberately breaks the product code in-process for the fast probes (KV reuse off, batching off,
group prefix sharing off, cache-aware routing replaced by round-robin, speculation drafting nothing) to show the
gate catches it; without ``--fast`` it implies ``--with-fast``. ``--repeat N`` runs the fast probes N times and
prints each figure's spread. ``--write-baselines`` prints the fast probes' figures (``--fast``), or accepts the
recorded results as the "full" baselines, keeping each figure's noise band.

Usage: python bench/gate.py [--fast | --with-fast | --targets] [--inject NAME] [--repeat N] [--only BENCH ...]
                            [--require BENCH ...] [--results DIR] [--write-baselines]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH = Path(__file__).resolve().parent
BASELINES = BENCH / "baselines.json"
INJECTIONS = ("kv-off", "no-batching", "no-group-sharing", "round-robin", "no-speculation")
NOISE_FLOOR = 0.02  # the least band: a seeded or count-based figure repeats exactly, but a harmless change may move it
NOISE_ONE_RUN = 0.25  # one comparable recorded run: no spread to measure, so a conservative band


def measured_noise(runs: Sequence[float]) -> float:
    """The noise band of a figure from its recorded runs: max/min - 1, rounded up to a percent, at least
    ``NOISE_FLOOR``; ``NOISE_ONE_RUN`` for a single run. Any run of the set then passes against a baseline taken
    from any other, whichever the direction."""
    if not runs:
        raise ValueError("no runs to measure a noise band from")
    lo, hi = min(runs), max(runs)
    if len(runs) == 1:
        return NOISE_ONE_RUN
    if lo == hi:
        return NOISE_FLOOR
    if lo <= 0:
        raise ValueError(f"a band is a factor: runs that differ must be positive, got {list(runs)}")
    return max(NOISE_FLOOR, math.ceil(round((hi / lo - 1) * 100, 6)) / 100)


def _meets(value: float, bound: float, better: str) -> bool:
    if better == "higher":
        return value >= bound
    if better == "lower":
        return value <= bound
    raise ValueError(f"'better' must be 'higher' or 'lower', got {better!r}")


def noise_bound(baseline: float, noise: float, better: str) -> float:
    """The worst value within a factor 1 + ``noise`` of ``baseline`` (a zero baseline allows nothing worse)."""
    if better == "higher":
        return baseline - abs(baseline) * noise / (1 + noise)
    return baseline + abs(baseline) * noise


@dataclass(frozen=True)
class Verdict:
    """One figure against its accepted baseline."""

    figure: str
    value: float | None
    baseline: float
    better: str
    bound: float  # the worst value that still passes
    band: str  # the allowance as printed: "1.18x" (a noise band) or "+/-0.05" (a fast probe's tolerance)
    required: bool = True  # a missing figure fails only when its benchmark was to run

    @property
    def tolerance(self) -> float:
        """How far from the baseline, in the figure's units, a value may be worse and still pass."""
        return abs(self.bound - self.baseline)

    @property
    def ok(self) -> bool:
        if self.value is None:
            return not self.required
        return _meets(self.value, self.bound, self.better)

    @property
    def delta(self) -> str:
        """The change from the baseline: relative, or absolute where the baseline is zero."""
        if self.value is None:
            return ""
        if self.baseline == 0:
            return f"{self.value:+.4g}"
        return f"{round(100 * (self.value - self.baseline) / abs(self.baseline), 1) + 0.0:+.1f} %"  # no "-0.0"

    @property
    def status(self) -> str:
        if self.value is None:
            return "MISSING" if self.required else "not run (not gated)"
        return "ok" if self.ok else "REGRESSED"


def check(
    figures: dict[str, float], baselines: dict[str, Any], required: Collection[str] | None = None
) -> list[Verdict]:
    """One verdict per baseline entry. A "full" entry passes within a factor 1 + ``noise`` of its accepted
    ``baseline``; a "fast" entry within ``tolerance`` of its ``value``. A missing figure fails when ``required``
    names its benchmark (the part of the name before the first dot), or when ``required`` is None."""
    out = []
    for name, spec in sorted(baselines.items()):
        better = spec["better"]
        if better not in ("higher", "lower"):
            raise ValueError(f"{name}: 'better' must be 'higher' or 'lower', got {better!r}")
        if "baseline" in spec:
            base, noise = float(spec["baseline"]["value"]), float(spec["baseline"]["noise"])
            bound, band = noise_bound(base, noise, better), f"{1 + noise:.2f}x"
        elif "value" in spec:
            base, tol = float(spec["value"]), float(spec["tolerance"])
            bound, band = (base - tol if better == "higher" else base + tol), f"+/-{tol:.4g}"
        else:
            raise ValueError(f"{name}: no baseline to gate against (accept one: bench/gate.py --write-baselines)")
        need = required is None or name.split(".", 1)[0] in required
        out.append(Verdict(name, figures.get(name), base, better, bound, band, need))
    return out


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def table(verdicts: list[Verdict]) -> str:
    rows = [("figure", "value", "baseline", "band", "fails if", "change", "")]
    for v in verdicts:
        value = "—" if v.value is None else f"{v.value:.4g}"
        fails = f"{'<' if v.better == 'higher' else '>'} {v.bound:.4g}"
        rows.append((v.figure, value, f"{v.baseline:.4g}", v.band, fails, v.delta, v.status))
    return "\n".join(_columns(rows))


@dataclass(frozen=True)
class Gap:
    """One figure against its target (``--targets``)."""

    figure: str
    value: float | None
    target: float
    better: str
    unmet: dict[str, Any] | None  # the entry's documentation of a target this machine cannot meet

    @property
    def met(self) -> bool:
        return self.value is not None and _meets(self.value, self.target, self.better)

    @property
    def short(self) -> float:
        """How far the value falls short of the target (positive: a miss)."""
        assert self.value is not None
        return self.target - self.value if self.better == "higher" else self.value - self.target

    @property
    def reason(self) -> str:
        if self.unmet is None:
            return "not documented: add an 'unmet' note (measured figure, reason) to bench/baselines.json"
        return str(self.unmet["reason"])


def gaps(figures: dict[str, float], section: dict[str, Any]) -> list[Gap]:
    return [
        Gap(name, figures.get(name), float(spec["target"]), spec["better"], spec.get("unmet"))
        for name, spec in sorted(section.items())
    ]


def targets_report(found: list[Gap]) -> str:
    """Every figure against its target: a table (figure, value, target, gap, relative gap), then each miss's
    reason. A report, not a gate: the caller exits 0."""
    rows = [("figure", "value", "target", "gap", "gap %", "")]
    for g in found:
        target = f"{'>=' if g.better == 'higher' else '<='} {g.target:.4g}"
        if g.value is None:
            rows.append((g.figure, "—", target, "", "", "not recorded"))
            continue
        gap = rel = ""
        if not g.met:
            gap = f"{g.short:.4g}"
            rel = f"{100 * g.short / abs(g.target):.1f} %" if g.target else ""
        status = "met" if g.met else "UNMET" if g.unmet is None else "unmet (documented)"
        if g.met and g.unmet is not None:
            status = "met (documented as unmet: drop its 'unmet' note)"
        rows.append((g.figure, f"{g.value:.4g}", target, gap, rel, status))
    lines = _columns(rows)
    misses = [g for g in found if g.value is not None and not g.met]
    if misses:
        lines.append("\nwhy each target is unmet:")
        lines += [f"  {g.figure}: {g.reason}" for g in misses]
    recorded = sum(g.value is not None for g in found)
    lines.append(
        f"\n{len(misses)} of {recorded} recorded figures miss their target "
        f"({sum(g.unmet is not None for g in misses)} documented). A report, not a gate: "
        "make bench-gate fails on regressions against the accepted baselines."
    )
    return "\n".join(lines)


# -- fast, deterministic probes ------------------------------------------------------------------------


async def embedded_probes(inject: str | None) -> dict[str, float]:
    """Count-based figures of the embedded engine (greedy decoding, token and forward-pass counters)."""
    from core.types import GenerateRequest, Message, SamplingParams
    from engines.config import EmbeddedConfig
    from engines.embedded.engine import EmbeddedEngine

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
        figures.update(await speculation_probes(engine, inject))
        return figures
    finally:
        await engine.close()


async def speculation_probes(engine: Any, inject: str | None) -> dict[str, float]:
    """Greedy tool-call episodes with drafts off vs on: target forward passes per generated token, identity."""
    from bench import spec_workload as workload
    from bench.speculation import Tally, run_episode
    from core.types import SamplingParams
    from speculation.config import SpeculationConfig
    from speculation.drafters import SpeculativeDrafter
    from speculation.grammar import CompiledToolGrammar, ll_tokenizer

    compiled = CompiledToolGrammar(workload.grammar(), ll_tokenizer(engine.tokenizer.hf_tokenizer))
    drafters = () if inject == "no-speculation" else ("grammar", "ngram")
    tallies = {"off": Tally(), "on": Tally()}
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    for ep in workload.episodes(2):
        prompt = engine.tokenizer.render_prompt(list(ep.messages), list(ep.tool_schemas))
        for name, config in (("off", ()), ("on", drafters)):
            drafter = SpeculativeDrafter(SpeculationConfig(enabled=True, drafters=config), compiled)
            ids, _, forwards = await run_episode(engine, prompt, drafter, greedy)
            drafter.draft([*prompt, *ids], 0)  # let the span tracker see the last token
            t = tallies[name]
            t.outputs.append(ids)
            t.tokens += len(ids)
            t.forwards += forwards
            t.span_tokens += drafter.stats.span_tokens
            t.span_steps += drafter.stats.span_steps
    off, on = tallies["off"], tallies["on"]
    same = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True)) / len(off.outputs)
    return {
        "speculation.tokens_per_forward_gain": (on.tokens / on.forwards) / (off.tokens / off.forwards),
        "speculation.span_tokens_per_step": on.span_tokens / max(1, on.span_steps),
        "speculation.identical_outputs": same,
    }


def fleet_probes(inject: str | None) -> dict[str, float]:
    """The seeded fleet simulator at a small scale (simulated time, so the figures do not depend on the machine)."""
    import placement.routing.factory as policies
    from bench.fleet_sim import experiments as ex

    scale = ex.Scale(replicas=4, concurrency=96, duration=30.0, warmup=10.0, grpo_samples=64, grpo_steps=1)
    real = policies.CacheAware
    if inject == "round-robin":  # the product's cache-aware policy silently routing round-robin
        policies.CacheAware = lambda replicas, *_, **__: policies.RoundRobin(replicas)  # type: ignore[assignment,misc]
    try:
        ag = ex.agentic(scale, ("round_robin", "cache_aware", "oracle"))
        gr = ex.grpo(scale, 8, ("cache_aware",))
    finally:
        policies.CacheAware = real  # type: ignore[misc]
    rr, ca, orc = ag["round_robin"], ag["cache_aware"], ag["oracle"]
    return {
        "fleet.agentic_cache_aware_over_round_robin_tput": ca.throughput / rr.throughput,
        "fleet.agentic_cache_aware_hit_over_oracle": ca.hit_ratio / orc.hit_ratio,
        "fleet.grpo8_cache_aware_prompt_prefills_per_group": gr["cache_aware"][1],
    }


def fast_figures(inject: str | None) -> dict[str, float]:
    figures = asyncio.run(embedded_probes(inject))
    figures.update(fleet_probes(inject))
    return figures


def recorded_runs(
    only: list[str] | None = None, results: Path | None = None
) -> dict[str, tuple[str, dict[str, float]]]:
    """The last recorded run of each benchmark (``bench/results/*.json``): its date and its figures, by name: its
    same-run ratios and its numeric figures (some targets are absolute: ms added, Steps/s, seconds to plan), a
    figure one level down as ``<group>.<name>``; a ratio wins a clash."""
    runs: dict[str, tuple[str, dict[str, float]]] = {}
    for path in sorted((results or BENCH / "results").glob("*.json")):
        payload = json.loads(path.read_text())
        if only and payload["benchmark"] not in only:
            continue
        found = dict(payload.get("figures", {}))
        for group, values in payload.get("figures", {}).items():
            if isinstance(values, dict):
                found.update({f"{group}.{k}": v for k, v in values.items()})
        found.update(payload.get("ratios", {}))
        figures = {k: float(v) for k, v in found.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        runs[payload["benchmark"]] = (str(payload.get("date", "?")), figures)
    return runs


def recorded_figures(only: list[str] | None = None, results: Path | None = None) -> dict[str, float]:
    """The last recorded run's figures of every benchmark, as ``<benchmark>.<name>``."""
    return {f"{b}.{k}": v for b, (_, figures) in recorded_runs(only, results).items() for k, v in figures.items()}


def accept(section: dict[str, Any], runs: dict[str, tuple[str, dict[str, float]]]) -> list[str]:
    """Make each recorded figure its entry's accepted baseline, in place: the value and when it was recorded. The
    entry keeps its noise band and the runs it was measured from; an entry without a baseline gets the one-run
    band. Returns a line per baseline that moved."""
    moved = []
    for name, spec in section.items():
        bench, key = name.split(".", 1)
        if key not in runs.get(bench, ("", {}))[1]:
            continue
        date, figures = runs[bench]
        value = round(figures[key], 6)
        old = spec.get("baseline")
        if old is not None and old["value"] == value:
            continue
        fresh = {
            "noise": NOISE_ONE_RUN,
            "noise_from": f"one recorded run: no spread to measure, default band {NOISE_ONE_RUN:.0%}",
            "runs": [value],
        }
        spec["baseline"] = {
            **(old or fresh),
            "value": value,
            "recorded": f"{date} (bench/results/{bench}.json)",
        }
        before = "none" if old is None else f"{float(old['value']):.6g}"
        moved.append(f"{name}: {before} -> {value:.6g}")
    return moved


def spread(runs: list[dict[str, float]]) -> str:
    rows = [("figure", "min", "max", "spread")]
    for name in sorted(runs[0]):
        values = [r[name] for r in runs]
        rows.append((name, f"{min(values):.6g}", f"{max(values):.6g}", f"{max(values) - min(values):.3g}"))
    return "\n".join(_columns(rows))


def _failed(names: list[str]) -> int:
    print(
        f"\nperformance gate FAILED: {len(names)} figure(s) regressed beyond their band: "
        f"{', '.join(sorted(names))} (baselines: {BASELINES.relative_to(BENCH.parent)}; see the table above)",
        file=sys.stderr,
    )
    return 1


def fast_gate(section: dict[str, Any], inject: str | None, repeat: int, write: bool) -> int:
    """The fast probes ``repeat`` times against the "fast" section (``make test``'s gate)."""
    runs = [fast_figures(inject) for _ in range(repeat)]
    if write:
        print(json.dumps({k: round(v, 6) for k, v in sorted(runs[-1].items())}, indent=2))
        return 0
    failed: set[str] = set()
    for i, figures in enumerate(runs, 1):
        verdicts = check(figures, section)
        if repeat > 1:
            print(f"\n-- run {i}/{repeat}")
        print(table(verdicts))
        failed |= {v.figure for v in verdicts if not v.ok}
    if repeat > 1:
        print(f"\nspread over {repeat} runs:\n{spread(runs)}")
    if failed:
        return _failed(sorted(failed))
    print(f"\nperformance gate passed ({len(section)} figures)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fast", action="store_true", help="only the deterministic probes (what make test runs)")
    mode.add_argument("--with-fast", action="store_true", help="the recorded figures and the fast probes")
    mode.add_argument("--targets", action="store_true", help="report every figure vs its target; never fails")
    parser.add_argument("--inject", choices=INJECTIONS, help="break the product in the fast probes (test the gate)")
    parser.add_argument("--repeat", type=int, default=1, help="with --fast: run the probes N times, print the spread")
    parser.add_argument("--only", nargs="+", metavar="BENCH", help="only these benchmarks' figures (each required)")
    parser.add_argument("--require", nargs="+", metavar="BENCH", default=[], help="fail if their figures are missing")
    parser.add_argument("--results", type=Path, help="read the runs' JSON here (default bench/results)")
    parser.add_argument(
        "--write-baselines",
        action="store_true",
        help="--fast: print the probes' figures; otherwise accept the recorded figures as the baselines",
    )
    args = parser.parse_args(argv)
    if args.repeat != 1 and not args.fast:
        parser.error("--repeat runs the fast probes N times: use it with --fast")

    baselines = json.loads(BASELINES.read_text())
    if args.fast:
        return fast_gate(baselines["fast"], args.inject, args.repeat, args.write_baselines)
    full = {k: v for k, v in baselines["full"].items() if not args.only or k.split(".", 1)[0] in args.only}
    if args.targets:
        print(targets_report(gaps(recorded_figures(args.only, args.results), full)))
        return 0
    if args.write_baselines:
        moved = accept(full, recorded_runs(args.only, args.results))
        baselines["full"].update(full)
        BASELINES.write_text(json.dumps(baselines, indent=2) + "\n")
        print("\n".join(moved) or "baselines already match the recorded results")
        print(f"{len(moved)} baseline(s) accepted into {BASELINES.relative_to(BENCH.parent)} (noise bands kept)")
        return 0

    verdicts = check(recorded_figures(args.only, args.results), full, {*(args.only or ()), *args.require})
    print(f'recorded figures (bench/results) vs accepted baselines ({BASELINES.relative_to(BENCH.parent)}, "full"):')
    print(table(verdicts))
    failed = [v.figure for v in verdicts if not v.ok]
    gated = sum(v.value is not None for v in verdicts)
    if args.with_fast or args.inject:
        fast = check(fast_figures(args.inject), baselines["fast"])
        print(f'\nfast probes{f" (injected: {args.inject})" if args.inject else ""} vs "fast" baselines:')
        print(table(fast))
        failed += [v.figure for v in fast if not v.ok]
        gated += len(fast)
    if failed:
        return _failed(failed)
    not_run = len(verdicts) - sum(v.value is not None for v in verdicts)
    print(
        f"\nperformance gate passed: {gated} figures within their bands"
        + (f", {not_run} not run" if not_run else "")
        + " (targets: make bench-targets)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
