"""The Space's entry point: LLMServeEnv (``llmserve/app.py``, openenv-core's ``create_app``) on port 7860.

``uv run --project . server``, ``python -m server.app`` from this directory, or the Dockerfile's command.
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from llmserve.app import app

__all__ = ["app", "main"]


def main(host: str = "0.0.0.0", port: int | None = None) -> None:
    """Serve the environment (``PORT`` overrides the default 7860, as Spaces set it)."""
    parser = argparse.ArgumentParser(description="LLMServeEnv Space server")
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=int, default=port or int(os.environ.get("PORT", "7860")))
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
