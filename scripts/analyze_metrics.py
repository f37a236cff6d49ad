"""Summarise a Prometheus scrape of the bridge (``curl -s HOST:9300/metrics > scrape.txt``).

    python scripts/analyze_metrics.py scrape.txt            # or '-' for stdin, or an http:// URL
    python scripts/analyze_metrics.py scrape.txt --json     # the same summary as JSON

Prints every counter (total over its series, and the largest label sets), every gauge (value, or min / max
over series), every histogram (count, mean, p50 / p90 / p99 interpolated in the buckets as PromQL's
``histogram_quantile`` does), then figures derived from the bridge's own series (prefix-cache hit rate,
tokens per turn, RPC errors). Parsing is prometheus_client's; a malformed scrape exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUANTILES = (0.5, 0.9, 0.99)


def read_scrape(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=10) as resp:
            return str(resp.read().decode())
    with open(source, encoding="utf-8") as f:
        return f.read()


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """``histogram_quantile``: linear interpolation inside the bucket holding rank ``q * count``."""
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the top finite bound, as Prometheus answers
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return math.nan


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""


def summarise(text: str) -> dict[str, Any]:
    """The scrape as {counters, gauges, histograms, derived}; raises ValueError on a malformed scrape."""
    counters: dict[str, Any] = {}
    gauges: dict[str, Any] = {}
    histograms: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            series = {_labels(s.labels): s.value for s in fam.samples if s.name.endswith("_total")}
            top = sorted(series.items(), key=lambda kv: -kv[1])[:3]
            counters[fam.name] = {"total": sum(series.values()), "series": len(series), "top": top}
            coded = [s for s in fam.samples if s.name.endswith("_total") and "code" in s.labels]
            if coded:  # gRPC status per call: what did not end OK
                counters[fam.name]["not_ok"] = sum(s.value for s in coded if s.labels["code"] != "OK")
        elif fam.type == "gauge" and not fam.name.endswith("_created"):
            values = [s.value for s in fam.samples]
            if values:
                gauges[fam.name] = {"min": min(values), "max": max(values), "series": len(values)}
        elif fam.type == "histogram":
            buckets: dict[float, float] = defaultdict(float)
            count = total = 0.0
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    buckets[float(s.labels["le"])] += s.value
                elif s.name.endswith("_count"):
                    count += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
            ordered = sorted(buckets.items())
            histograms[fam.name] = {
                "count": count,
                "mean": total / count if count else math.nan,
                **{f"p{round(q * 100)}": quantile(q, ordered) for q in QUANTILES},
            }
    return {"counters": counters, "gauges": gauges, "histograms": histograms, "derived": derive(counters)}


def derive(counters: dict[str, Any]) -> dict[str, float]:
    def total(name: str) -> float:
        return float(counters.get(name, {}).get("total", 0.0))

    out: dict[str, float] = {}
    prompt, cached, turns = total("primerl_prompt_tokens"), total("primerl_cached_tokens"), total("primerl_turns")
    if prompt:
        out["prefix_cache_hit_rate"] = cached / prompt
    if turns:
        out["generated_tokens_per_turn"] = total("primerl_generated_tokens") / turns
        out["prompt_tokens_per_turn"] = prompt / turns
    rpc = counters.get("primerl_rpc_handled")
    if rpc:
        out["rpc_total"] = rpc["total"]
        out["rpc_not_ok"] = rpc.get("not_ok", 0.0)
    return out


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def render(summary: dict[str, Any]) -> str:
    lines = [f"counters ({len(summary['counters'])})"]
    for name, c in sorted(summary["counters"].items()):
        top = ", ".join(f"{lbl or '{}'}={_fmt(v)}" for lbl, v in c["top"] if v)
        lines.append(f"  {name:<48} {_fmt(c['total']):>10}  {top}")
    lines.append(f"gauges ({len(summary['gauges'])})")
    for name, g in sorted(summary["gauges"].items()):
        value = _fmt(g["max"]) if g["min"] == g["max"] else f"{_fmt(g['min'])}..{_fmt(g['max'])}"
        lines.append(f"  {name:<48} {value:>10}  ({g['series']} series)")
    lines.append(f"histograms ({len(summary['histograms'])})")
    for name, h in sorted(summary["histograms"].items()):
        qs = " ".join(f"p{round(q * 100)}={_fmt(h[f'p{round(q * 100)}'])}" for q in QUANTILES)
        lines.append(f"  {name:<48} count={_fmt(h['count'])} mean={_fmt(h['mean'])} {qs}")
    lines.append("derived")
    for name, value in summary["derived"].items():
        lines.append(f"  {name:<48} {_fmt(value):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scrape", help="a /metrics text dump, '-' for stdin, or an http(s) URL to scrape")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = summarise(read_scrape(args.scrape))
    except (OSError, ValueError) as exc:
        print(f"analyze_metrics: cannot read {args.scrape}: {exc}", file=sys.stderr)
        return 2
    if not (summary["counters"] or summary["gauges"] or summary["histograms"]):
        print(f"analyze_metrics: {args.scrape} holds no Prometheus metrics", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1, default=str) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
