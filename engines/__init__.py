"""Inference engines behind one small protocol (``engines.base.Engine``).

``make_engines(config)`` builds the configured engine's replicas; engine modules are
imported lazily so that heavy dependencies (torch, httpx) load only when used.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin while they wait by default: with the bridge's own threads (and, on a shared
# machine, other processes) competing for the cores, a spinning team turns a 0.1 s decode step into ~1 s
# (measured: SmolLM2-135M on 2 busy cores, 1.01 s/token spinning vs 0.10 s passive). Set before torch loads;
# an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engines.base import Engine, Tokenizer
from engines.config import EngineConfig

__all__ = ["Engine", "EngineConfig", "Tokenizer", "make_engines"]


async def make_engines(config: EngineConfig) -> list[Engine]:
    """Start the replicas of the configured engine (one per URL for remote engines)."""
    from core.errors import InvalidArgument

    if config.type == "toy":
        from engines.toy import ToyEngine

        return [ToyEngine(config.toy, model=config.model, replica=f"toy-{i}") for i in range(config.replicas)]
    if config.type == "embedded":
        from engines.embedded.engine import EmbeddedEngine

        return [
            await EmbeddedEngine.start(config.embedded, model=config.model, replica=f"embedded-{i}")
            for i in range(config.replicas)
        ]
    if config.type in ("vllm", "sglang", "trtllm"):
        from engines.http.remote import make_remote_engines

        return list(await make_remote_engines(config))
    raise InvalidArgument(f"engine type {config.type!r} is not available in this build")
