"""An environment's tool grammar: ``grammar_for`` turns its ``ToolSpec`` list into a ``core.grammar.ToolGrammar``."""

from __future__ import annotations

from collections.abc import Sequence

from core.grammar import ToolGrammar
from envhub.types import ToolSpec


def grammar_for(env_name: str, tools: Sequence[ToolSpec]) -> ToolGrammar:
    """The grammar of an environment's tools (in the order offered to the model)."""
    return ToolGrammar(env_name=env_name, tools=tuple((t.name, t.parameters) for t in tools))
