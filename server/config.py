"""The one settings root of the bridge.

Layered as every ``primerl`` entry point (core.layered_config), highest first: CLI flags
(``--engine.type toy``, and the short ones of ``primerl serve``: ``--engine``, ``--port`` ...) >
config files (``@ a.toml @ b.toml`` left to right; ``--config FILE`` is ``@ FILE``) > environment
(``PRIMERL_*``, ``__`` nests: ``PRIMERL_ENGINE__TYPE=toy``; aliases ``PRIMERL_ENGINE`` and
``PRIMERL_ENGINE_BASE_URL``) > field defaults. Until issue 23 the environment beat the file.
Each package owns its section's model (``engines.config.EngineConfig`` ...); components receive
their section, never the root.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cache.config import CacheConfig
from core.layered_config import load_config
from core.types import SamplingParams
from engines.config import EngineConfig
from envhub.config import EnvHubConfig
from placement.registry import FleetConfig
from placement.routing import RoutingConfig
from server.auth import AuthConfig, TlsConfig
from server.inspector.config import InspectorConfig
from server.persistence import PersistenceConfig
from speculation.config import SpeculationConfig


class ServerConfig(BaseModel):
    """The gRPC listener and its lifecycle."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Interface to bind; use 0.0.0.0 or [::] to accept remote trainers.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free port.")
    grace_period_s: float = Field(
        30.0, ge=0, le=3600, description="On shutdown, how long in-flight Steps may finish before being cancelled."
    )
    stream_interval_ms: float = Field(
        2.0,
        ge=0,
        le=1000,
        description="Streamed Steps send the first token at once, then coalesce tokens that arrive within this "
        "interval into one chunk (0 = one chunk per engine chunk).",
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted or sent (trajectories can be large)."
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Bridge processes sharing the port (SO_REUSEPORT), each with its own event loop; an episode's "
        "calls are forwarded to the worker that started it (server.fleet.workers). 1 = this process serves.",
    )


class HttpConfig(BaseModel):
    """The HTTP front door (vLLM token route, OpenAI routes, sessions, admin) on the gRPC server's host."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the front door; 0 disables it.")
    session_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="A session untouched this long is discarded (its episodes freed) when new sessions open.",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond it).")


class AdmissionConfig(BaseModel):
    """Limits enforced before any work is accepted (RESOURCE_EXHAUSTED beyond them)."""

    model_config = ConfigDict(extra="forbid")

    max_episodes: int = Field(10_000, ge=1, description="Open episodes per bridge.")
    max_episodes_per_tenant: int = Field(
        0, ge=0, description="Open episodes per tenant (auth on); 0 = only the bridge-wide limit applies."
    )
    max_inflight_steps: int = Field(
        4096, ge=1, description="Steps running at once on this bridge; beyond it RESOURCE_EXHAUSTED with retry-after."
    )
    max_inflight_steps_per_tenant: int = Field(
        0, ge=0, description="Steps running at once per tenant; 0 = only the bridge-wide limit applies."
    )
    max_tokens_per_episode: int = Field(
        32_768, ge=2, description="Tokens per episode (prompt + observations + samples); generation stops there."
    )
    max_group_size: int = Field(256, ge=1, description="Largest GRPO group one StartEpisode may open.")
    max_tokens_per_turn: int = Field(8192, ge=1, description="Upper bound on sampling.max_tokens.")
    max_staleness: int = Field(
        0,
        ge=0,
        description="Refuse (FAILED_PRECONDITION) a Step on an episode that started more than this many policy "
        "versions before the current one; 0 = off.",
    )
    weight_update_drain_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A weight update outside a fleet waits this long for the running turns to end (mode keep) "
        "before aborting them; in a fleet, fleet.update_timeout_s bounds the whole update.",
    )


# Sampling parameters used where neither the episode nor the turn sets them: the one sampling type itself
# (its field annotations carry the bounds and docs), so ``[sampling]`` / ``PRIMERL_SAMPLING__*`` set any of
# its fields, and a field added there is configurable here without a second list.
SamplingDefaults = SamplingParams


class MetricsConfig(BaseModel):
    """Prometheus endpoint."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(9300, ge=0, le=65535, description="Port of /metrics; 0 disables the endpoint.")
    health_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="How often engine replicas are health-checked (gauge, routing rotation, gRPC health status).",
    )


class RedisConfig(BaseModel):
    """Shared state (prefix-cache index, episode persistence)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field("", description="redis:// URL; empty keeps all state in process.")


class Settings(BaseModel):
    """Root of the bridge configuration (see module docstring for precedence; load it with load_settings)."""

    model_config = ConfigDict(extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig, description="gRPC listener.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP front door (OpenAI / vLLM routes).")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Admission limits.")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults, description="Default sampling.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis.")
    envhub: EnvHubConfig = Field(default_factory=EnvHubConfig, description="Env hub: tool connectors and loop.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Prefix-cache index for cache-aware routing.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="How turns are placed on replicas.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer-token authentication and tenants.")
    persistence: PersistenceConfig = Field(
        default_factory=PersistenceConfig, description="Durable episodes in Redis (resume after restart, share)."
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="TLS / mutual TLS of the gRPC port.")
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="Grammar-aware speculative decoding of tool calls."
    )
    fleet: FleetConfig = Field(
        default_factory=FleetConfig, description="Fleet membership: registry, one policy version per model."
    )
    inspector: InspectorConfig = Field(
        default_factory=InspectorConfig, description="The live inspector (/ui): its bounded memory of episodes."
    )

    @model_validator(mode="after")
    def _constrained_needs_a_masking_engine(self) -> Settings:
        # Only the embedded engine samples under a grammar mask; the others would decode unconstrained.
        if self.speculation.enabled and self.speculation.mode == "constrained" and self.engine.type != "embedded":
            raise ValueError(
                f"speculation.mode 'constrained' needs engine.type 'embedded' (the only engine that decodes "
                f"under a grammar mask); engine {self.engine.type!r} supports speculation.mode 'draft-only'"
            )
        return self


# Short environment names of the quick start (docker-compose and the product README use them).
ENV_ALIASES = {"PRIMERL_ENGINE": "engine.type", "PRIMERL_ENGINE_BASE_URL": "engine.urls"}


def load_settings(
    config_file: str | Path | Sequence[str | Path] | None = None,
    *,
    argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build the settings: ``overrides`` > ``argv`` flags > config file(s) > environment > defaults.

    ``config_file`` is one TOML file or several (merged left to right); ``argv`` holds layered-config
    tokens (``@ FILE``, ``--section.key VALUE``); ``env`` replaces ``os.environ``; ``overrides`` are
    nested dicts by section, e.g. ``engine={"type": "toy"}``. Raises core.layered_config.ConfigError
    (a ValueError) naming the bad key or value.
    """
    files = [] if config_file is None else [config_file] if isinstance(config_file, (str, Path)) else config_file
    return load_config(Settings, argv, files=files, overrides=overrides, env=env, env_aliases=ENV_ALIASES)
