"""Configuration of turn routing (``Settings.routing``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PolicyName = Literal["cache_aware", "round_robin", "least_loaded", "sticky", "consistent_hash"]


class RoutingConfig(BaseModel):
    """Turn routing across engine replicas (``Settings.routing``; placement/routing/)."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field(
        "cache_aware",
        description="Routing policy (one module each in placement/routing/). cache_aware needs the prefix index: "
        "without one (cache.enabled=false, or a single replica) it runs sticky, logged at start and counted with "
        "reason fallback_sticky; every other policy runs as configured.",
    )
    prefill_weight: float = Field(
        1.0, ge=0, le=100, description="Cost of one uncached prompt token relative to one in-flight token."
    )
    cache_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A new episode whose prompt is cached beyond this share on a replica that is not hot goes to the "
        "replica with the longest cached prefix, whatever the loads (SGLang's cache_threshold; 1 = always weigh load "
        "against uncached tokens).",
    )
    balance_abs_tokens: int = Field(
        16384, ge=0, description="A replica is hot only if its load exceeds the least-loaded one's by this many tokens."
    )
    balance_rel: float = Field(
        1.5, ge=1, le=100, description="... and is more than this many times the least-loaded replica's load."
    )
    group_colocate: bool = Field(True, description="Place every member of a GRPO group on one replica.")
    hash_vnodes: int = Field(64, ge=1, le=4096, description="Virtual nodes per replica on the consistent-hash ring.")
    ring_load_bound: float = Field(
        0.0, ge=0, description="Consistent hash: skip replicas above this x mean load (0 = plain ring, e.g. 1.25)."
    )
    ring_key: Literal["session", "prefix"] = Field(
        "session",
        description="Consistent hash key: session = group id, else episode id; prefix = the first block's hash "
        "(SGLang prefix_hash: one system prompt, one replica).",
    )
    plan_file: str = Field(
        "",
        description="A placement plan (`primerl placement plan --output FILE.json|.yaml`): its bridge_replicas' "
        "kv_capacity_tokens size the prefix index per replica (in engine order; the plan must list this model's "
        "replicas, as many as engine replicas). Empty: the index uses cache.capacity_blocks / "
        "default_capacity_blocks.",
    )
