#!/usr/bin/env python3
"""Summarise a Prometheus text dump of a bridge's /metrics: tokens per model, latency percentiles.

    curl -s localhost:9300/metrics > dump.txt
    python scripts/analyze_metrics.py dump.txt          # or '-' for stdin; --json for machine output

Percentiles are computed from the histogram buckets the way PromQL's ``histogram_quantile``
does (linear interpolation inside the bucket holding the rank), so they are estimates bounded
by the bucket edges. Several dumps (e.g. one per bridge replica) are summed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TOKENS = {
    "primerl_prompt_tokens_total": "prompt",
    "primerl_cached_tokens_total": "cached",
    "primerl_generated_tokens_total": "generated",
    "primerl_turns_total": "turns",
}
HISTOGRAMS = {"primerl_step_latency_seconds": "step_latency", "primerl_ttft_seconds": "ttft"}
QUANTILES = (0.5, 0.95, 0.99)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """PromQL's estimate of quantile ``q`` from cumulative ``(upper bound, count)`` buckets."""
    pairs = sorted(buckets)
    if not pairs or pairs[-1][1] == 0:
        return math.nan
    total = pairs[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in pairs:
        if count >= rank:
            if math.isinf(upper):
                return lower  # the rank lies beyond the last finite bound: report that bound
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def analyze(text: str) -> dict[str, Any]:
    """Per (model, engine): token totals, hit ratio, turns and latency percentiles; RPCs by code."""
    tokens: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    buckets: dict[tuple[str, str, str], dict[float, float]] = defaultdict(lambda: defaultdict(float))
    rpcs: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.labels.get("model", ""), s.labels.get("engine", ""))
            if s.name in TOKENS:
                tokens[key][TOKENS[s.name]] += s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in HISTOGRAMS:
                which = HISTOGRAMS[s.name[: -len("_bucket")]]
                buckets[(*key, which)][float(s.labels["le"])] += s.value
            elif s.name == "primerl_rpc_handled_total":
                rpcs[s.labels["code"]] += s.value
    models: dict[str, dict[str, Any]] = {}
    for key in sorted(set(tokens) | {(m, e) for m, e, _ in buckets}):
        t = tokens.get(key, {})
        row: dict[str, Any] = {k: int(t.get(k, 0)) for k in ("prompt", "cached", "generated", "turns")}
        row["hit_ratio"] = row["cached"] / row["prompt"] if row["prompt"] else None
        for which in HISTOGRAMS.values():
            b = buckets.get((*key, which))
            if b:
                row[f"{which}_count"] = int(max(b.values()))
                for q in QUANTILES:
                    row[f"{which}_p{round(q * 100)}_s"] = histogram_quantile(q, b.items())
        models[f"{key[0]}/{key[1]}"] = row
    return {"models": models, "rpcs_by_code": dict(sorted(rpcs.items()))}


def _fmt_s(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.1f} ms"


def render(summary: dict[str, Any]) -> str:
    lines = []
    header = ["model/engine", "prompt", "cached", "generated", "turns", "hit ratio"]
    header += [f"step p{round(q * 100)}" for q in QUANTILES] + [f"ttft p{round(q * 100)}" for q in QUANTILES]
    lines.append(" | ".join(header))
    lines.append(" | ".join("---" for _ in header))
    for name, r in summary["models"].items():
        cells = [name, *(str(r[k]) for k in ("prompt", "cached", "generated", "turns"))]
        cells.append("-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.3f}")
        cells += [_fmt_s(r.get(f"step_latency_p{round(q * 100)}_s")) for q in QUANTILES]
        cells += [_fmt_s(r.get(f"ttft_p{round(q * 100)}_s")) for q in QUANTILES]
        lines.append(" | ".join(cells))
    if summary["rpcs_by_code"]:
        lines.append("")
        lines.append("RPCs by status code: " + ", ".join(f"{c}={int(n)}" for c, n in summary["rpcs_by_code"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("dumps", nargs="+", help="Prometheus text files ('-' reads stdin)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    text = "".join(sys.stdin.read() if p == "-" else Path(p).read_text(encoding="utf-8") for p in args.dumps)
    summary = analyze(text)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
