"""The one settings root of the bridge.

Precedence (lowest first): field defaults < TOML file (``--config FILE``) < environment
(``PRIMERL_*``, ``__`` nests: ``PRIMERL_ENGINE__TYPE=toy``) < CLI flags. Each package owns
its section's model (``engines.config.EngineConfig`` ...); components receive their section,
never the root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from cache.config import CacheConfig
from engines.config import EngineConfig
from engines.types import SamplingParams
from envhub.config import EnvHubConfig
from placement.routing import RoutingConfig
from server.auth import AuthConfig, TlsConfig
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


class Settings(BaseSettings):
    """Root of the bridge configuration (see module docstring for precedence)."""

    model_config = SettingsConfigDict(env_prefix="PRIMERL_", env_nested_delimiter="__", extra="forbid")

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

    @model_validator(mode="after")
    def _constrained_needs_a_masking_engine(self) -> Settings:
        # Only the embedded engine samples under a grammar mask; the others would decode unconstrained.
        if self.speculation.enabled and self.speculation.mode == "constrained" and self.engine.type != "embedded":
            raise ValueError(
                f"speculation.mode 'constrained' needs engine.type 'embedded' (the only engine that decodes "
                f"under a grammar mask); engine {self.engine.type!r} supports speculation.mode 'draft-only'"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First source wins: CLI (passed as init kwargs) > environment > TOML file.
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from a TOML file, the environment and explicit (CLI) overrides.

    ``overrides`` are nested dicts by section, e.g. ``engine={"type": "toy"}``.
    """
    if config_file is not None and not Path(config_file).is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=config_file)

    return Settings.model_validate(_FromFile(**overrides).model_dump())
