"""Configuration of the verifier service (``primerl verifier serve``; the ``verifier`` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class VerifierConfig(BaseModel):
    """Where the log lives, who signs, how graders run."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Interface the HTTP JSON surface binds.")
    http_port: int = Field(8700, ge=0, le=65535, description="HTTP JSON port (0 = any free port).")
    grpc_port: int = Field(8701, ge=0, le=65535, description="gRPC port (primerl.v1.Verifier; 0 = any free port).")
    bridge: str = Field(
        "", max_length=300, description="HOST:PORT of a bridge whose episodes Score may end and grade by episode id."
    )
    database_url: str = Field(
        "sqlite:///primerl-verifier.sqlite3",
        description="sqlite:///PATH (relative to the working directory; sqlite:////abs/path), or a "
        "postgresql:// / postgres:// URL for PostgreSQL.",
    )
    key_dir: str = Field(
        "primerl-verifier-keys", description="Directory of Ed25519 signing keys (created with a first key if empty)."
    )
    origin: str = Field(
        "primerl-servekit/verifier",
        min_length=1,
        max_length=200,
        description="Checkpoint origin line and the note key name (no spaces, no '+').",
    )
    grader_timeout_s: float = Field(10.0, gt=0, le=3600, description="Per-item deadline of one grader call.")
    grader_threads: int = Field(4, ge=1, le=256, description="Threads graders run in (graders are synchronous).")
    max_batch: int = Field(
        256, ge=1, le=10_000, description="Most verdicts appended in one transaction (one checkpoint per batch)."
    )
    max_batch_items: int = Field(1024, ge=1, le=100_000, description="Most items one POST /v1/score/batch may carry.")
    max_tokens: int = Field(1_000_000, ge=1, description="Most tokens one trajectory may have.")

    @field_validator("origin")
    @classmethod
    def _origin(cls, v: str) -> str:
        if any(c.isspace() or c == "+" for c in v):
            raise ValueError("the origin is a note key name: no whitespace and no '+'")
        return v

    @field_validator("database_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError("database_url must start with sqlite:///, postgresql:// or postgres://")
        return v
