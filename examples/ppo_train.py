"""PPO through the bridge: SmolLM2-135M with a value head on the arithmetic-with-a-calculator task.

Each step samples ``--prompts x --samples`` episodes through ``rl_client`` (same environment and rater as
``grpo_train.py``), estimates token values with a linear value head on the policy's last hidden state,
computes token-level GAE over the sampled tokens (reward on the last one; env and prompt tokens are not
steps), runs ``--epochs`` of the clipped surrogate on the whole model, fits the value head for
``--value-iters`` steps on the cached (detached) hidden states, saves the weights and pushes them with
``UpdateWeights``. Prints per step: mean reward, the value loss on the fresh batch *before* the head is fitted
to it (its generalisation error; the number that should fall), after fitting, and explained variance.
The value head lives only in the trainer (the bridge serves the policy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_train import specs_for, start_bridge

from grpo import advantages as adv
from grpo.masks import loss_mask
from grpo.sampler import Group, GroupSampler
from grpo.tasks import ArithmeticEnv, Problem, arithmetic_rater, make_problems
from rl_client import AsyncBridgeClient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--samples", type=int, default=8, help="episodes per prompt (one StartEpisode group)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--value-lr", type=float, default=1e-4)
    p.add_argument("--value-iters", type=int, default=20, help="value-head steps per batch on cached features")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--call-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/out/ppo_run")
    p.add_argument("--bridge", default="")
    p.add_argument("--engine", default="embedded")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    return p.parse_args(argv)


class PPOTrainer:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from engines.model_store import ensure_converted, load_model_and_tokenizer

        torch.manual_seed(args.seed)
        self.args = args
        self.model, _ = load_model_and_tokenizer(ensure_converted())
        self.model.train()
        hidden = int(self.model.config.hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0)
        self.value_opt = torch.optim.Adam(self.value_head.parameters(), lr=args.value_lr)

    def _values(self, hidden: Any) -> Any:
        # the value head reads detached features: value regression does not move the policy
        return self.value_head(hidden.detach()).squeeze(-1)

    def step(self, groups: list[Group[Problem]]) -> dict[str, float]:
        import torch

        from grpo.losses import clipped_surrogate, value_loss
        from grpo.policy import group_forward, pad_right

        a = self.args
        batches = []
        features = []  # last hidden states of the no-grad pass: the value head's inputs
        with torch.no_grad():  # old values and GAE targets, one pass per group
            for g in groups:
                trajs = g.trajectories
                p = trajs[0].prompt_length
                comps = [t.token_ids[p:] for t in trajs]
                fwd = group_forward(
                    self.model, trajs[0].token_ids[:p], comps, with_hidden=True, temperature=a.temperature
                )
                assert fwd.hidden is not None
                old_v = self._values(fwd.hidden)
                mask = pad_right([loss_mask(t)[p:] for t in trajs], 0, torch.bool) & fwd.mask
                advs = torch.zeros_like(old_v)
                rets = torch.zeros_like(old_v)
                for i, reward in enumerate(g.rewards):
                    idx = torch.nonzero(mask[i]).squeeze(-1)
                    if idx.numel() == 0:
                        continue
                    r = np.zeros(idx.numel())
                    r[-1] = reward
                    a_i, ret_i = adv.gae(r, old_v[i, idx].numpy(), gamma=a.gamma, lam=a.lam)
                    advs[i, idx] = torch.as_tensor(a_i, dtype=advs.dtype)
                    rets[i, idx] = torch.as_tensor(ret_i, dtype=rets.dtype)
                old_lp = pad_right(
                    [np.nan_to_num(t.logprobs[p:], nan=0.0, neginf=0.0) for t in trajs], 0.0, torch.float32
                )
                batches.append((trajs[0].token_ids[:p], comps, mask, old_lp, old_v, advs, rets))
                features.append(fwd.hidden)
        # whiten advantages over the batch's trained tokens
        flat = torch.cat([b[5][b[2]] for b in batches])
        mu, sd = float(flat.mean()), float(flat.std()) + 1e-8
        # value loss on this (fresh) batch before the head sees it: the head's generalisation error
        with torch.no_grad():
            before = float(
                np.mean(
                    [
                        value_loss(self._values(f), b[4], b[6], b[2], clip=1e9)
                        for f, b in zip(features, batches, strict=True)
                    ]
                )
            )
            rets_all = torch.cat([b[6][b[2]] for b in batches])
            resid = torch.cat([(b[6] - b[4])[b[2]] for b in batches])
            explained = (
                1.0 - float(resid.var()) / float(rets_all.var())
                if rets_all.numel() > 1 and float(rets_all.var()) > 0
                else 0.0
            )
        pls = []
        for _ in range(a.epochs):  # policy: clipped surrogate, whole model
            self.opt.zero_grad(set_to_none=True)
            for prompt, comps, mask, old_lp, _old_v, advs, _rets in batches:
                fwd = group_forward(self.model, prompt, comps, temperature=a.temperature)
                pl, _ = clipped_surrogate(
                    fwd.logprobs, old_lp, (advs - mu) / sd, mask, clip_low=a.clip, clip_high=a.clip
                )
                (pl / len(batches)).backward()
                pls.append(float(pl.detach()))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        # value head: a few cheap regression steps on the cached features (no model forward needed)
        after = before
        for _ in range(a.value_iters):
            self.value_opt.zero_grad(set_to_none=True)
            vl = sum(
                value_loss(self._values(f), b[4], b[6], b[2], clip=1e9) for f, b in zip(features, batches, strict=True)
            )
            (vl / len(batches)).backward()
            self.value_opt.step()
            after = float(vl.detach()) / len(batches)
        return {
            "value_loss": before,
            "value_loss_after_fit": after,
            "policy_loss": float(np.mean(pls)),
            "explained_var": explained,
        }


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    from grpo.policy import save_for_bridge

    trainer = PPOTrainer(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any rollout
    problems = make_problems(1024, seed=args.seed)
    proc = None
    target = args.bridge
    if not target:
        proc, target = start_bridge(args.engine)
    history: list[dict[str, float]] = []
    try:
        async with AsyncBridgeClient(target, timeout=900) as client:
            await client.wait_until_ready(timeout=900)
            sampler: GroupSampler[Problem] = GroupSampler(client, ArithmeticEnv, arithmetic_rater(), concurrency=4)
            gargs = argparse.Namespace(**vars(args), group_size=args.samples)
            print(
                f"{'step':>4} {'reward':>7} {'value loss':>10} {'after fit':>9} {'expl. var':>9} {'rollout s':>9} "
                f"{'train s':>7}"
            )
            for step in range(args.steps):
                batch = [problems[(step * args.prompts + i) % len(problems)] for i in range(args.prompts)]
                groups, st = await sampler.collect(specs_for(batch, gargs))
                t0 = time.perf_counter()
                stats = await asyncio.to_thread(trainer.step, groups)
                await asyncio.to_thread(save_for_bridge, trainer.model, out / "weights")
                version = await client.update_weights(str((out / "weights").resolve()))
                row = {
                    "step": step,
                    "reward": float(np.mean(st.rewards)),
                    "rollout_s": st.seconds,
                    "train_s": time.perf_counter() - t0,
                    "version": version,
                    **stats,
                }
                history.append(row)
                print(
                    f"{step:>4} {row['reward']:>7.3f} {row['value_loss']:>10.4f} {row['value_loss_after_fit']:>9.4f} "
                    f"{row['explained_var']:>9.2f} "
                    f"{row['rollout_s']:>9.1f} {row['train_s']:>7.1f}",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind so the bridge subprocess is stopped
    history = asyncio.run(run(args))
    if len(history) >= 2:
        k = max(1, len(history) // 3)
        first = float(np.mean([h["value_loss"] for h in history[:k]]))
        last = float(np.mean([h["value_loss"] for h in history[-k:]]))
        verdict = "falls" if last < first else "does not fall"
        print(f"\nvalue loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f} ({verdict})")
        if not args.no_record:
            from bench._common import record

            record(
                "ppo_train",
                f"PPO demo through the bridge ({args.prompts}x{args.samples} episodes/step, {args.epochs} epochs)",
                [
                    ("steps run", str(len(history)), ""),
                    (f"value loss, first {k} -> last {k} steps", f"{first:.4f} -> {last:.4f}", "falls"),
                    (
                        "mean reward, first -> last step",
                        f"{history[0]['reward']:.3f} -> {history[-1]['reward']:.3f}",
                        "",
                    ),
                    (
                        "rollout / train time per step (mean)",
                        f"{np.mean([h['rollout_s'] for h in history]):.1f} s / "
                        f"{np.mean([h['train_s'] for h in history]):.1f} s",
                        "",
                    ),
                ],
                {"history": history, "value_loss_first": first, "value_loss_last": last},
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
