"""Speculation settings (the ``speculation`` section of ``server.config.Settings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["draft-only", "constrained"]
DrafterName = Literal["grammar", "ngram"]


class SpeculationConfig(BaseModel):
    """Grammar-aware speculative decoding of tool calls (issue 9)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Attach a drafter to turns of episodes that have tool schemas.")
    mode: Mode = Field(
        "draft-only",
        description="draft-only: the grammar only proposes drafts, output is exactly the policy's distribution; "
        "constrained: decode under the grammar mask inside tool-call spans (changes the distribution; forced "
        "tokens carry origin FORCED).",
    )
    drafters: tuple[DrafterName, ...] = Field(
        ("grammar", "ngram"),
        description="Drafters in priority order: grammar = the matcher's forced (fast-forward) tokens; ngram = "
        "prompt lookup in the episode's own tokens (filtered by the grammar inside tool-call spans).",
    )
    max_draft_tokens: int = Field(8, ge=1, le=64, description="Longest draft verified in one target forward.")
    min_ngram: int = Field(1, ge=1, le=8, description="Shortest suffix the n-gram drafter looks up.")
    max_ngram: int = Field(3, ge=1, le=8, description="Longest suffix the n-gram drafter looks up.")
    item_separator: str = Field(", ", description="JSON item separator the grammar expects (json.dumps style).")
    key_separator: str = Field(": ", description="JSON key separator the grammar expects (json.dumps style).")
    gate_min_acceptance: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Adaptive gate: outside tool-call spans, stop drafting once the moving acceptance rate of "
        "draft tokens falls below this (break-even); drafting resumes when a tool-call span starts.",
    )
    gate_window: int = Field(64, ge=1, le=4096, description="Draft tokens the gate's moving average spans.")
    gate_min_samples: int = Field(32, ge=0, le=4096, description="Draft tokens seen before the gate may close.")
