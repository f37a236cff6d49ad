"""``primerl llmserve serve|train|evaluate``.

* ``serve [--host H] [--port P]``: the LLMServeEnv OpenEnv server (uvicorn, default port 7860);
* ``train --task T --steps N --seed S [--out DIR]``: BC warm start + PPO on the simulator
  (``llmserve/ppo.py``); weights to ``DIR/<task>/`` (default ``~/.cache/primerl/llmserve/ppo``,
  or ``$LLMSERVE_PPO_DIR``);
* ``evaluate --agent ppo|heuristic|random|llm [...] --task all --episodes 20 [--weights DIR]``: the
  benchmark table (mean return and grade per agent per task, margins) on held-out seeds; ``llm`` asks
  the chat endpoint at ``$OPENAI_BASE_URL`` (``llmserve/llm.py``) and is never in the default set.
"""

from __future__ import annotations

import argparse


def add_llmserve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    llm = subparsers.add_parser("llmserve", help="LLMServeEnv: OpenEnv environment for LLM-serving policies")
    sub = llm.add_subparsers(dest="llmserve_command", required=True)
    serve = sub.add_parser("serve", help="serve LLMServeEnv with openenv-core (HTTP + /ws)")
    serve.add_argument("--host", default="0.0.0.0", help="interface to bind")
    serve.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    train = sub.add_parser("train", help="train a PPO policy on the simulator (CPU, torch)")
    train.add_argument("--task", required=True, help="task id (see GET /tasks)")
    train.add_argument("--steps", type=int, default=20_000, help="PPO environment steps after the BC warm start")
    train.add_argument("--seed", type=int, default=0, help="torch/numpy seed")
    train.add_argument("--out", default=None, help="weights directory (default ~/.cache/primerl/llmserve/ppo)")
    ev = sub.add_parser("evaluate", help="print the benchmark table on held-out seeds")
    ev.add_argument(
        "--agent",
        action="append",
        choices=["ppo", "heuristic", "random", "llm"],
        help="repeatable; default ppo, heuristic, random (llm: a chat model at $OPENAI_BASE_URL)",
    )
    ev.add_argument("--task", default="all", help="a task id or 'all'")
    ev.add_argument("--episodes", type=int, default=20, help="episodes per agent and task (seeds 0..N-1)")
    ev.add_argument("--weights", default=None, help="PPO weights directory (as train's --out)")


def run_llmserve(args: argparse.Namespace) -> int:
    if args.llmserve_command in ("train", "evaluate"):
        from llmserve.llm import LLMEndpointError
        from llmserve.tasks import UnknownTaskError

        try:
            return _train(args) if args.llmserve_command == "train" else _evaluate(args)
        except (UnknownTaskError, FileNotFoundError, LLMEndpointError) as exc:  # a clear message, not a traceback
            raise SystemExit(f"error: {exc}") from None
    import uvicorn

    uvicorn.run("llmserve.app:app", host=args.host, port=args.port, log_level="warning")
    return 0


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmserve.ppo import DEFAULT_OUT, TrainConfig, train
    from llmserve.tasks import get_task

    if args.steps < 0:
        raise SystemExit("--steps must be >= 0")
    get_task(args.task)
    out = Path(args.out) if args.out else DEFAULT_OUT
    stats = train(TrainConfig(task_id=args.task, steps=args.steps, seed=args.seed), out)
    print(
        f"{args.task}: trained in {stats['train_seconds']:.1f} s; greedy validation return "
        f"{stats['best_val_return']:.3f} (BC {stats['bc_val_return']:.3f}, heuristic "
        f"{stats['heuristic_val_return']:.3f}); weights in {out / args.task}"
    )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from llmserve.evaluate import evaluate, resolve_tasks, table

    if args.episodes < 1:
        raise SystemExit("--episodes must be >= 1")
    agents = args.agent or ["ppo", "heuristic", "random"]
    cells = evaluate(agents, resolve_tasks(args.task), list(range(args.episodes)), args.weights)
    print(table(cells))
    return 0
