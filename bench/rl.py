"""``make run``'s GRPO demo with its timings recorded: ``primerl rl --bench``, then ``bench/RESULTS.md``.

``python -m bench.rl @ examples/grpo.toml`` takes ``primerl rl``'s configuration (``@`` files, flags, the
environment) and runs it with ``--bench``: the run writes its figures and per-step rows to
``<out_dir>/bench.json`` (``grpo.cli``), recorded here as ``rl_<algorithm>_<sync|async>``. The library never
imports ``bench/``; recording is this script's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import record
from core.layered_config import load_config
from grpo.cli import RLConfig, run_command


def record_run(cfg: RLConfig) -> None:
    """Record the figures the run ``cfg`` wrote to ``<out_dir>/bench.json``."""
    figures = json.loads((Path(cfg.out_dir) / "bench.json").read_text())
    rows = figures["per_step"]
    k = max(1, min(5, len(rows) // 2))
    mode = f"async (max_async_level={cfg.max_async_level})" if cfg.max_async_level else "sync"
    record(
        f"rl_{cfg.algorithm}_{'async' if cfg.max_async_level else 'sync'}",
        f"primerl rl ({cfg.algorithm}, {mode}, {cfg.rollout.num_prompts}x{cfg.rollout.group_size} episodes/step)",
        [
            ("steps run", str(len(rows)), f"<= {cfg.max_steps}"),
            (
                f"mean reward, first {k} -> last {k} steps",
                f"{figures['reward_first']:.3f} -> {figures['reward_last']:.3f}",
                "",
            ),
            ("rollout time / step (mean)", f"{figures['rollout_s_mean']:.1f} s", ""),
            ("train time / step incl. weight push (mean)", f"{figures['train_s_mean']:.1f} s", ""),
            ("generated tokens/s during rollouts (mean)", f"{figures['tokens_per_s_mean']:.1f}", ""),
            ("wall time incl. bridge start", f"{figures['wall_s'] / 60:.1f} min", ""),
        ],
        figures,
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    status = run_command("rl", [*args, "--bench"])
    if status or any(a in ("-h", "--help", "--dry-run") for a in args):
        return status
    record_run(load_config(RLConfig, args))  # the configuration the run resolved, from the same sources
    return 0


if __name__ == "__main__":
    sys.exit(main())
