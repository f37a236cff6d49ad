"""The ``primerl`` subcommands ``grpo.cli`` serves, named without importing it (``primerl serve`` stays free of
torch); ``server.cli`` imports ``grpo.cli.run_command`` only when one of them runs."""

from __future__ import annotations

from typing import Any

COMMANDS = ("rl", "trainer", "orchestrator")


def add_rl_parsers(sub: Any) -> None:
    """List the entry points in ``primerl --help`` (their flags are layered config: ``primerl rl --help``)."""
    for name, text in (
        ("rl", "single-node RL: in one process (@ rl.toml) or as three (--trainer @ --orchestrator @ --inference @)"),
        ("trainer", "the trainer process: batches in, one weights directory per step out (@ trainer.toml)"),
        ("orchestrator", "the orchestrator process: rollouts through a bridge (bridge.target), batches out"),
    ):
        sub.add_parser(name, help=text, add_help=False)


__all__ = ["COMMANDS", "add_rl_parsers"]
