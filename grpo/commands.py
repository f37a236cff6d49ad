"""The ``primerl`` subcommands ``grpo.cli`` serves, named without importing it (``primerl serve`` stays free of
torch); ``server.cli`` imports ``grpo.cli.run_command`` only when one of them runs."""

from __future__ import annotations

from typing import Any

COMMANDS = ("rl", "trainer", "orchestrator")


def add_rl_parsers(sub: Any) -> None:
    """List the entry points in ``primerl --help`` (their flags are layered config: ``primerl rl --help``)."""
    for name, text in (
        ("rl", "single-node RL: a bridge child, the orchestrator and the trainer (@ rl.toml, --max-steps, --ckpt)"),
        ("trainer", "the RL loop against a running bridge (bridge.target)"),
        ("orchestrator", "the RL loop against a running bridge (bridge.target)"),
    ):
        sub.add_parser(name, help=text, add_help=False)


__all__ = ["COMMANDS", "add_rl_parsers"]
