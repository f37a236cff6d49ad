"""``primerl llmserve serve [--host H] [--port P]``: the LLMServeEnv OpenEnv server (uvicorn)."""

from __future__ import annotations

import argparse


def add_llmserve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    llm = subparsers.add_parser("llmserve", help="LLMServeEnv: OpenEnv environment for LLM-serving policies")
    sub = llm.add_subparsers(dest="llmserve_command", required=True)
    serve = sub.add_parser("serve", help="serve LLMServeEnv with openenv-core (HTTP + /ws)")
    serve.add_argument("--host", default="0.0.0.0", help="interface to bind")
    serve.add_argument("--port", type=int, default=7860, help="port (default 7860)")


def run_llmserve(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run("envhub.llmserve.app:app", host=args.host, port=args.port, log_level="warning")
    return 0
