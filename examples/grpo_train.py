"""`make run`: GRPO that learns through the bridge — the arithmetic-with-a-calculator task on SmolLM2-135M.

Each step: sample ``--prompts`` GRPO groups of ``--group-size`` through ``rl_client`` (one StartEpisode per
group: the engine prefills each prompt once), two turns per episode (tool call, tool result, answer), rate
them (``grpo.tasks.arithmetic_rater``), compute GRPO advantages, take one clipped-surrogate optimizer step
on torch CPU, save the weights and push them with ``UpdateWeights``. ``--async-level k`` (k >= 1) collects
the rollouts of step n+1 while step n trains, never more than k policy versions behind
(``grpo.pipeline``); stale groups are dropped and counted (``grpo.masks.StalenessFilter``).

Prints a per-step table, saves ``reward_curve.png`` and ``history.json`` under ``--out``, appends the
per-step timings to ``bench/RESULTS.md``. ``--resume`` continues from ``--out/trainer_state.pt``.
The bridge is started as a subprocess on the embedded engine unless ``--bridge HOST:PORT`` is given.
The run stops after ``--steps`` or when ``--max-minutes`` of training time is spent, whichever is first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo import advantages as adv
from grpo.masks import StalenessFilter, loss_mask, oldest_version
from grpo.pipeline import Pipeline
from grpo.sampler import Group, GroupSampler, GroupSpec, SamplerStats
from grpo.tasks import TOOLS, ArithmeticEnv, Problem, arithmetic_rater, make_problems
from rl_client import AsyncBridgeClient


@dataclass
class StepRow:
    step: int
    reward: float
    correct: float
    version: int
    tokens_per_s: float
    kv_reuse: float
    rollout_s: float
    train_s: float
    lag: int
    dropped: int
    clip_frac: float
    loss: float
    ratio: float = 1.0  # mean importance ratio over trained tokens (meaningless when trained == 0)
    trained: int = 0  # groups with a learning signal (not all rewards equal) that the update used
    components: dict[str, float] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--max-minutes", type=float, default=12.0, help="start no step that would end after this (training time)"
    )
    p.add_argument("--prompts", type=int, default=1, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the initial weights (0 = off)")
    p.add_argument("--estimator", choices=["grpo", "dr_grpo", "rloo"], default="grpo")
    p.add_argument("--aggregation", choices=["seq_mean", "token_mean", "constant"], default="seq_mean")
    p.add_argument("--async-level", type=int, default=0, help="max_async_level; 0 = synchronous")
    p.add_argument("--call-tokens", type=int, default=32, help="max_tokens of the tool-call turn")
    p.add_argument("--answer-tokens", type=int, default=8, help="max_tokens of the answer turn")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/grpo_run")
    p.add_argument("--resume", action="store_true", help="continue from --out/trainer_state.pt")
    p.add_argument("--save-every", type=int, default=5, help="write trainer_state.pt every N steps (and at the end)")
    p.add_argument("--bridge", default="", help="HOST:PORT of a running bridge (default: start one)")
    p.add_argument("--engine", default="embedded")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    return p.parse_args(argv)


def start_bridge(engine: str) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "server", "serve", "--engine", engine, "--port", str(port), "--metrics-port", "0"]
    cmd += ["--log-level", "WARNING"]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent), f"127.0.0.1:{port}"


class Trainer:
    """Holds the torch model, the optimizer and the run's history; one ``train_step`` per batch of groups."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from engines.model_store import ensure_converted, load_model_and_tokenizer

        torch.manual_seed(args.seed)
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.weights_dir = self.out / "weights"
        src = ensure_converted()
        self.model, _ = load_model_and_tokenizer(src)
        self.model.train()
        self.model.config.use_cache = True
        self.ref: Any = None
        if args.kl_coef > 0:
            self.ref, _ = load_model_and_tokenizer(src)
            self.ref.eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.filter = StalenessFilter(args.async_level, mode="drop")
        self.history: list[StepRow] = []
        self.start_step = 0
        self.version = 0

    # -- checkpoint / resume -------------------------------------------------------------------------
    def save_state(self, step: int) -> None:
        import torch

        state = {
            "step": step,
            "version": self.version,
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "history": [asdict(r) for r in self.history],
            "torch_rng": torch.get_rng_state(),
        }
        tmp = self.out / "trainer_state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "trainer_state.pt")

    def load_state(self) -> bool:
        import torch

        path = self.out / "trainer_state.pt"
        if not path.exists():
            return False
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.history = [StepRow(**r) for r in state["history"]]
        self.start_step = int(state["step"]) + 1
        torch.set_rng_state(state["torch_rng"])
        return True

    # -- one optimizer step --------------------------------------------------------------------------
    def train_step(self, groups: list[Group[Problem]]) -> dict[str, float]:
        import torch

        from grpo.losses import clipped_surrogate, kl_k3
        from grpo.policy import group_forward, pad_right

        a = self.args
        kept: list[tuple[Group[Problem], np.ndarray, float]] = []
        for g in groups:
            verdict = self.filter.judge(g.trajectories, self.version)
            if verdict.keep:
                kept.append((g, adv.grpo(g.rewards) if a.estimator == "grpo" else _est(a.estimator, g.rewards), 1.0))
        n_active = sum(int(np.any(x[1] != 0)) for x in kept)
        stats = {"loss": 0.0, "clip_frac": 0.0, "ratio": 0.0, "trained": float(n_active)}
        if n_active == 0:
            return stats
        self.opt.zero_grad(set_to_none=True)
        for g, advantages, weight in kept:
            if not np.any(advantages != 0):
                continue  # all-equal rewards: no signal, skip the compute
            trajs = g.trajectories
            p = trajs[0].prompt_length
            prompt = trajs[0].token_ids[:p]
            completions = [t.token_ids[p:] for t in trajs]
            masks = [loss_mask(t)[p:] for t in trajs]
            old = [np.nan_to_num(t.logprobs[p:], nan=0.0, posinf=0.0, neginf=0.0) for t in trajs]
            fwd = group_forward(self.model, prompt, completions, temperature=a.temperature)
            mask = pad_right(masks, 0, torch.bool) & fwd.mask
            old_lp = pad_right(old, 0.0, torch.float32)
            adv_t = torch.as_tensor(advantages, dtype=torch.float32)[:, None].expand_as(old_lp)
            loss, st = clipped_surrogate(
                fwd.logprobs, old_lp, adv_t, mask, clip_low=a.clip, clip_high=a.clip, mode=a.aggregation
            )
            if self.ref is not None:
                with torch.no_grad():
                    ref_lp = group_forward(self.ref, prompt, completions, temperature=a.temperature).logprobs
                loss = loss + a.kl_coef * (kl_k3(fwd.logprobs, ref_lp) * mask).sum() / mask.sum().clamp(min=1)
            (loss * weight / n_active).backward()
            stats["loss"] += float(loss.detach()) / n_active
            stats["clip_frac"] += st["clip_frac"] / n_active
            stats["ratio"] += st["ratio_mean"] / n_active
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if not torch.isfinite(norm):  # never push non-finite weights to the bridge
            self.opt.zero_grad(set_to_none=True)
            stats["skipped"], stats["trained"] = 1.0, 0.0
            return stats
        self.opt.step()
        return stats


def _est(name: str, rewards: list[float]) -> np.ndarray:
    return adv.dr_grpo(rewards) if name == "dr_grpo" else adv.rloo(rewards)


def specs_for(problems: list[Problem], args: argparse.Namespace) -> list[GroupSpec[Problem]]:
    return [
        GroupSpec(
            prompt=pr.messages(),
            problem=pr,
            group_size=args.group_size,
            sampling={"temperature": args.temperature, "max_tokens": args.call_tokens},
            tools=TOOLS,
            turn_sampling=[None, {"max_tokens": args.answer_tokens}],
            max_turns=2,
        )
        for pr in problems
    ]


def print_row(r: StepRow, header: bool = False) -> None:
    from tqdm import tqdm

    if header:
        tqdm.write(
            f"{'step':>4} {'reward':>7} {'correct':>7} {'version':>7} {'tok/s':>7} {'KV reuse':>8} "
            f"{'rollout s':>9} {'train s':>7} {'lag':>3} {'dropped':>7} {'trained':>7} {'ratio':>6}"
        )
    ratio = f"{r.ratio:>6.3f}" if r.trained else f"{'-':>6}"  # no group had signal: no update, no ratio
    tqdm.write(
        f"{r.step:>4} {r.reward:>7.3f} {r.correct:>7.3f} {r.version:>7} {r.tokens_per_s:>7.1f} {r.kv_reuse:>8.1%} "
        f"{r.rollout_s:>9.1f} {r.train_s:>7.1f} {r.lag:>3} {r.dropped:>7} {r.trained:>7} {ratio}"
    )


async def run(args: argparse.Namespace) -> list[StepRow]:
    from tqdm import tqdm

    trainer = Trainer(args)
    resumed = args.resume and trainer.load_state()
    rng = random.Random(args.seed)
    all_problems = make_problems(4096, seed=args.seed)
    bridge: subprocess.Popen[bytes] | None = None
    target = args.bridge
    if not target:
        bridge, target = start_bridge(args.engine)
    try:
        async with AsyncBridgeClient(target, timeout=900) as client:
            await client.wait_until_ready(timeout=900)
            info = (await client.server_info()).models[0]
            print(f"bridge ready: {info.name} on {info.engine}, policy v{info.policy_version}", flush=True)
            if resumed:
                from grpo.policy import save_for_bridge

                save_for_bridge(trainer.model, trainer.weights_dir)
                trainer.version = await client.update_weights(str(trainer.weights_dir.resolve()))
                print(f"resumed at step {trainer.start_step}, bridge now serves v{trainer.version}", flush=True)
            else:
                trainer.version = info.policy_version
            sampler: GroupSampler[Problem] = GroupSampler(client, ArithmeticEnv, arithmetic_rater(), concurrency=4)
            rater = sampler.rater
            rng.seed(args.seed * 1_000_003 + trainer.start_step)
            t_start = time.perf_counter()
            bar = tqdm(total=args.steps, initial=trainer.start_step, desc="GRPO steps", unit="step")
            collected: dict[int, tuple[list[Group[Problem]], SamplerStats]] = {}

            async def collect(step: int) -> tuple[list[Group[Problem]], SamplerStats]:
                problems = [all_problems[(step * args.prompts + i) % len(all_problems)] for i in range(args.prompts)]
                return await sampler.collect(specs_for(problems, args))

            async def train(step: int, batch: tuple[list[Group[Problem]], SamplerStats]) -> int:
                from grpo.policy import save_for_bridge

                groups, st = batch
                dropped_before = trainer.filter.stats.samples_dropped
                oldest = [oldest_version(t) for g in groups for t in g.trajectories]
                lag = max([trainer.version - v for v in oldest if v is not None], default=0)
                t0 = time.perf_counter()
                stats = await asyncio.to_thread(trainer.train_step, groups)
                await asyncio.to_thread(save_for_bridge, trainer.model, trainer.weights_dir)
                train_s = time.perf_counter() - t0
                version = await client.update_weights(str(trainer.weights_dir.resolve()))
                comps = [rater.components(r) for g in groups for r in g.rollouts]
                row = StepRow(
                    step=step,
                    reward=float(np.mean(st.rewards)),
                    correct=float(np.mean([c["correct"] for c in comps])),
                    version=trainer.version,
                    tokens_per_s=st.tokens_per_s,
                    kv_reuse=st.kv_reuse,
                    rollout_s=st.seconds,
                    train_s=train_s,
                    lag=lag,
                    dropped=trainer.filter.stats.samples_dropped - dropped_before,
                    clip_frac=stats["clip_frac"],
                    loss=stats["loss"],
                    ratio=stats["ratio"],
                    trained=int(stats["trained"]),
                    components={k: float(np.mean([c[k] for c in comps])) for k in comps[0]},
                )
                trainer.history.append(row)
                trainer.version = version
                print_row(row, header=len(trainer.history) == 1 or step == trainer.start_step)
                if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                    await asyncio.to_thread(trainer.save_state, step)  # model + AdamW state: ~1.6 GB
                bar.update(1)
                return version

            last = args.steps
            pipeline: Pipeline[tuple[list[Group[Problem]], SamplerStats]] = Pipeline(args.async_level, trainer.version)

            async def bounded_collect(step: int) -> tuple[list[Group[Problem]], SamplerStats]:
                # start a step only if it should end within the budget (at the mean step time so far)
                elapsed = time.perf_counter() - t_start
                done = step - trainer.start_step
                per_step = elapsed / done if done else 0.0
                if elapsed + per_step > args.max_minutes * 60:
                    raise _OutOfTime(step)
                return await collect(step)

            try:
                await pipeline.run(trainer.start_step, last, bounded_collect, train)
            except* _OutOfTime as eg:
                stop = eg.exceptions[0]
                tqdm.write(f"time budget of {args.max_minutes} min reached before step {stop.args[0]}")
                if trainer.history and (trainer.history[-1].step + 1) % args.save_every:
                    trainer.save_state(trainer.history[-1].step)
            bar.close()
            del collected
    finally:
        if bridge is not None:
            bridge.send_signal(signal.SIGTERM)
            bridge.wait(timeout=60)
    return trainer.history


class _OutOfTime(Exception):
    pass


def summarize(history: list[StepRow], args: argparse.Namespace, wall_s: float) -> dict[str, float]:
    rewards = [r.reward for r in history]
    k = min(5, len(rewards) // 2) or 1
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    out = {
        "k": float(k),
        "steps": float(len(history)),
        "first5_reward": first,
        "last5_reward": last,
        "delta": last - first,
        "first5_correct": float(np.mean([r.correct for r in history[:k]])),
        "last5_correct": float(np.mean([r.correct for r in history[-k:]])),
        "rollout_s_mean": float(np.mean([r.rollout_s for r in history])),
        "train_s_mean": float(np.mean([r.train_s for r in history])),
        "tokens_per_s_mean": float(np.mean([r.tokens_per_s for r in history])),
        "kv_reuse_mean": float(np.mean([r.kv_reuse for r in history])),
        "wall_s": wall_s,
    }
    print(
        f"\nmean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} (delta {last - first:+.3f}); "
        f"correct {out['first5_correct']:.2f} -> {out['last5_correct']:.2f}; wall {wall_s / 60:.1f} min"
    )
    return out


def per_step_table(history: list[StepRow]) -> str:
    lines = [
        "| step | mean reward | policy version | rollout s | train s | gen tok/s | KV reuse | lag | dropped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.step} | {r.reward:.3f} | {r.version} | {r.rollout_s:.1f} | {r.train_s:.1f} | {r.tokens_per_s:.1f} "
        f"| {r.kv_reuse:.1%} | {r.lag} | {r.dropped} |"
        for r in history
    ]
    return (
        "Per step (train s includes writing the checkpoint; KV reuse = cached / prompt tokens, all turns):\n\n"
        + "\n".join(lines)
    )


def plot(history: list[StepRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in history]
    ax.plot(steps, [r.reward for r in history], marker="o", label="mean reward")
    ax.plot(steps, [r.correct for r in history], marker=".", linestyle="--", label="correct answer")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (0-1)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SmolLM2-135M, arithmetic via calculator tool, GRPO through the bridge")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM unwinds like Ctrl-C, so the bridge subprocess is stopped by run()'s `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    history = asyncio.run(run(args))
    if not history:
        print("no steps ran")
        return 1
    summary = summarize(history, args, time.perf_counter() - t0)
    out = Path(args.out)
    plot(history, out / "reward_curve.png")
    (out / "history.json").write_text(
        json.dumps({"args": vars(args), "summary": summary, "steps": [asdict(r) for r in history]}, indent=1)
    )
    print(f"reward curve: {out / 'reward_curve.png'}")
    if not args.no_record:
        from bench._common import record

        mode = f"async (max_async_level={args.async_level})" if args.async_level else "sync"
        record(
            f"grpo_train_{'async' if args.async_level else 'sync'}",
            f"GRPO demo through the bridge ({mode}, {args.prompts}x{args.group_size} episodes/step)",
            [
                ("steps run", f"{len(history)}", f"<= {args.steps}"),
                (
                    f"mean reward, first {int(summary['k'])} -> last {int(summary['k'])} steps",
                    f"{summary['first5_reward']:.3f} -> {summary['last5_reward']:.3f}",
                    "+0.2",
                ),
                ("delta", f"{summary['delta']:+.3f}", ">= +0.2"),
                ("rollout time / step (mean)", f"{summary['rollout_s_mean']:.1f} s", ""),
                ("train time / step incl. checkpoint (mean)", f"{summary['train_s_mean']:.1f} s", ""),
                ("generated tokens/s during rollouts (mean)", f"{summary['tokens_per_s_mean']:.1f}", ""),
                ("prompt tokens served from KV reuse (mean)", f"{summary['kv_reuse_mean']:.1%}", ""),
                ("wall time incl. bridge start", f"{summary['wall_s'] / 60:.1f} min", "<= 15 min"),
            ],
            summary | {"per_step": [asdict(r) for r in history]},
            notes=per_step_table(history),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
