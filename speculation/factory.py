"""Per-turn drafters for the bridge: tool schemas (as sent in StartEpisode) -> compiled grammar -> drafter.

``SpeculationFactory`` is built once per engine tokenizer; ``drafter(tool_schemas)`` returns a fresh drafter
for one generation request (drafters keep per-request state) or None when speculation is off or constrained;
``constraint(tool_schemas)`` returns a fresh ``GrammarConstraint`` in constrained mode (else None). Compiled
grammars are cached by the schema strings (compiling once per env, not per turn).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from core.errors import InvalidArgument
from core.grammar import ToolGrammar
from core.types import Capability, EngineInfo
from speculation.config import SpeculationConfig
from speculation.constraint import GrammarConstraint
from speculation.drafters import SpeculativeDrafter
from speculation.grammar import CompiledToolGrammar, ll_tokenizer

log = logging.getLogger("primerl.server")


def speculation_for(
    config: SpeculationConfig | None, infos: Sequence[EngineInfo], tokenizer: Any
) -> SpeculationFactory | None:
    """The bridge's drafters (off by default): a drafter per turn for episodes with tools; engines verify exactly.
    InvalidArgument when the mode needs what a replica cannot do."""
    if config is None or not config.enabled:
        return None
    engine = infos[0].engine
    unable = [i.replica for i in infos if Capability.CONSTRAINTS not in i.capabilities]
    if config.mode == "constrained" and unable:  # they would silently decode unconstrained
        raise InvalidArgument(
            f"speculation.mode 'constrained' needs an engine that decodes under a grammar mask "
            f"(embedded); replicas {unable} ({engine}) cannot: use mode 'draft-only'"
        )
    plain = [i.replica for i in infos if Capability.DRAFT_VERIFY not in i.capabilities]
    if config.mode == "draft-only" and plain:  # said once here; Turns attaches no drafter for them
        why = "cannot verify drafts (capability 'draft_verify'): their turns decode plainly"
        log.warning("speculation on, but replicas %s (%s) %s", plain, engine, why)
    return SpeculationFactory(config, getattr(tokenizer, "hf_tokenizer", None))


def grammar_from_schemas(tool_schemas: Sequence[str], env_name: str = "") -> ToolGrammar | None:
    """The grammar of tools given as JSON strings (OpenAI function entries or bare ``{name, parameters}``)."""
    tools: list[tuple[str, dict[str, Any]]] = []
    for text in tool_schemas:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError:
            return None
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return None
        params = fn.get("parameters") or {"type": "object"}
        tools.append((fn["name"], params if isinstance(params, dict) else {"type": "object"}))
    return ToolGrammar(env_name=env_name, tools=tuple(tools)) if tools else None


MASKED_POSITIONS_KEY = "speculation.masked_positions"


def record_masked_positions(metadata: dict[str, str], constraint: Any, length: int) -> None:
    """Merge a turn's masked positions into the episode metadata (the trajectory's mask replay handle).

    ``metadata[MASKED_POSITIONS_KEY]`` is a JSON object ``{"position": allowed_count}`` over the episode's
    token ids (``length`` of them: a position the engine masked but whose token never arrived is left out):
    every generated position decoded under the grammar mask, with the number of tokens the mask allowed
    (1: forced, origin FORCED). Idempotent (a turn may be recorded twice); a client value under the key
    that is not such an object is replaced.
    """
    steps: dict[int, int] = dict(getattr(constraint, "steps", {}))  # one C-level copy: the engine may still write
    if not steps:
        return
    try:
        merged = json.loads(metadata.get(MASKED_POSITIONS_KEY, "{}"))
    except json.JSONDecodeError:
        merged = None
    if not isinstance(merged, dict):
        merged = {}
    merged.update({str(pos): count for pos, count in sorted(steps.items()) if pos < length})
    metadata[MASKED_POSITIONS_KEY] = json.dumps(merged, separators=(",", ":"))


class SpeculationFactory:
    """Drafters for one engine's tokenizer (see module docstring)."""

    def __init__(self, config: SpeculationConfig, hf_tokenizer: Any) -> None:
        self.config = config
        self._hf = hf_tokenizer
        self._compiled: dict[tuple[str, ...], CompiledToolGrammar | None] = {}
        self._lock = threading.Lock()

    def compiled(self, tool_schemas: Sequence[str], grammar: ToolGrammar | None = None) -> CompiledToolGrammar | None:
        key = tuple(tool_schemas) if grammar is None else (grammar.to_json(),)
        with self._lock:
            if key not in self._compiled:
                g = grammar or grammar_from_schemas(tool_schemas)
                try:
                    self._compiled[key] = (
                        CompiledToolGrammar(
                            g,
                            ll_tokenizer(self._hf),
                            item_separator=self.config.item_separator,
                            key_separator=self.config.key_separator,
                        )
                        if g is not None
                        else None
                    )
                except ValueError:
                    self._compiled[key] = None  # a schema llguidance cannot compile: n-gram drafts only
            return self._compiled[key]

    def drafter(
        self, tool_schemas: Sequence[str] = (), grammar: ToolGrammar | None = None
    ) -> SpeculativeDrafter | None:
        """A drafter for one generation request, or None when speculation is disabled (or not draft-only)."""
        if not self.config.enabled or self.config.mode != "draft-only":
            return None
        compiled = self.compiled(tool_schemas, grammar) if (tool_schemas or grammar is not None) else None
        return SpeculativeDrafter(self.config, compiled)

    def constraint(
        self, tool_schemas: Sequence[str] = (), grammar: ToolGrammar | None = None
    ) -> GrammarConstraint | None:
        """A grammar mask for one generation request in constrained mode, else None.

        None too when there are no tools or their grammar does not compile (the turn decodes plainly).
        """
        if not self.config.enabled or self.config.mode != "constrained":
            return None
        compiled = self.compiled(tool_schemas, grammar) if (tool_schemas or grammar is not None) else None
        return GrammarConstraint(compiled) if compiled is not None else None
