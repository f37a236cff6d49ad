#!/usr/bin/env bash
# The quick start's end-to-end loop, bounded in time: PPO, GRPO and the performance gate, plus the bridge
# leg (python -m server.main --engine toy, a /metrics scrape summarised by scripts/analyze_metrics.py, one
# verifier reward). Each gate fails the script (exit 1) with a line saying which:
#   GRPO  examples/grpo_train.py on the embedded SmolLM2 for $STEPS steps: every step ran an optimizer step and
#         pushed its weights (the policy version advances by one a step), losses and rewards finite;
#   PPO   examples/ppo_train.py for $STEPS steps: the same, with finite value losses;
#   bridge scripts/dev_loop_bridge.py: episodes through the quick-start bridge, scrape, signed verdict;
#   perf  bench/gate.py's deterministic fast probes against bench/baselines.json (what `make gate-fast` runs),
#         written as a CSV.
# Usage: scripts/dev_loop.sh            (from a checkout after `make dev`)
# Env:   STEPS=2 (training steps per algorithm), OUT=bench/out/dev_loop (run outputs),
#        ARTIFACTS=$OUT/artifacts (where the CSVs, scrape and verdict go; artifacts/ holds a committed sample),
#        SKIP=""  (space-separated legs to skip: grpo ppo bridge perf), PY=.venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-2}
OUT=${OUT:-bench/out/dev_loop}
ARTIFACTS=${ARTIFACTS:-$OUT/artifacts}
SKIP=${SKIP:-}
export PYTHONPATH=.
mkdir -p "$OUT" "$ARTIFACTS"
# Small rollouts: the loop checks that everything runs and learns a step, not how well (make run does that).
TINY=(--call-tokens 6 --answer-tokens 3 --no-record)

leg() { [[ " $SKIP " != *" $1 "* ]]; }
say() { printf '\n== %s\n' "$*"; }
fail() { echo "dev_loop: $*" >&2; exit 1; }

if leg grpo; then
  say "GRPO: $STEPS steps on the embedded engine"
  $PY examples/grpo_train.py --steps "$STEPS" --group-size 2 --max-minutes 15 "${TINY[@]}" --out "$OUT/grpo" \
    || fail "GRPO gate: the trainer exited non-zero"
  $PY - "$OUT/grpo/history.json" "$STEPS" "$ARTIFACTS/grpo_steps.csv" <<'EOF' || fail "GRPO gate failed"
import csv, json, math, sys
hist, steps, dest = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
rows = hist["steps"]
assert len(rows) == steps, f"{len(rows)} of {steps} steps ran"
versions = [r["version"] for r in rows]
assert versions == list(range(versions[0], versions[0] + steps)), f"policy versions {versions}: a push was lost"
assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows), "a loss or reward is not finite"
cols = ["step", "reward", "correct", "version", "tokens_per_s", "kv_reuse", "rollout_s", "train_s", "loss", "ratio"]
with open(dest, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(cols)
    w.writerows([[r[c] for c in cols] for r in rows])
print(f"GRPO gate passed: {steps} steps, rewards {[round(r['reward'], 3) for r in rows]}; per-step CSV {dest}")
EOF
fi

if leg ppo; then
  say "PPO: $STEPS steps on the embedded engine"
  $PY examples/ppo_train.py --steps "$STEPS" --samples 2 --epochs 1 "${TINY[@]}" --out "$OUT/ppo" \
    || fail "PPO gate: the trainer exited non-zero"
  $PY - "$OUT/ppo/history.json" "$STEPS" <<'EOF' || fail "PPO gate failed"
import json, math, sys
rows, steps = json.load(open(sys.argv[1])), int(sys.argv[2])
assert len(rows) == steps, f"{len(rows)} of {steps} steps ran"
versions = [r["version"] for r in rows]
assert versions == list(range(versions[0], versions[0] + steps)), f"policy versions {versions}: a push was lost"
assert all(math.isfinite(r["value_loss"]) and math.isfinite(r["reward"]) for r in rows), "a loss is not finite"
print(f"PPO gate passed: {steps} steps, value loss {[round(r['value_loss'], 4) for r in rows]}")
EOF
fi

if leg bridge; then
  say "bridge: python -m server.main --engine toy, /metrics scrape, verifier reward"
  $PY scripts/dev_loop_bridge.py --out "$ARTIFACTS" || fail "bridge leg failed (logs in $ARTIFACTS/*.log)"
  $PY scripts/analyze_metrics.py "$ARTIFACTS/metrics_scrape.txt" | tee "$ARTIFACTS/metrics_summary.txt" \
    || fail "analyze_metrics could not read the scrape"
fi

if leg perf; then
  say "perf gate: bench/gate.py --fast (deterministic probes vs bench/baselines.json)"
  $PY - "$ARTIFACTS/perf_gate.csv" <<'EOF' || fail "perf gate: a figure regressed (see the table above)"
import csv, json, sys
from bench import gate
verdicts = gate.check(gate.fast_figures(None), json.loads(gate.BASELINES.read_text())["fast"])
print(gate.table(verdicts))
with open(sys.argv[1], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["figure", "value", "baseline", "better", "tolerance", "ok"])
    w.writerows([[v.figure, v.value, v.baseline, v.better, v.tolerance, v.ok] for v in verdicts])
bad = [v.figure for v in verdicts if not v.ok]
print(f"perf gate {'FAILED: ' + ', '.join(bad) if bad else 'passed'} ({len(verdicts)} figures); CSV {sys.argv[1]}")
sys.exit(1 if bad else 0)
EOF
fi

say "dev loop passed (outputs in $OUT, artifacts in $ARTIFACTS)"
