"""Configuration of the env hub (the ``envhub`` section of the settings root).

Every guard has a safe default: the sandbox refuses to run without bubblewrap, SQL is
read-only with deadlines and caps, HTTP blocks every non-global address, the browser only
opens allowlisted origins.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sandbox.config import SandboxConfig


class SqlConfig(BaseModel):
    """Read-only SQL (SQLite and PostgreSQL)."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(2.0, gt=0, le=600, description="Per-statement deadline.")
    max_rows: int = Field(50, ge=1, le=100_000, description="Rows returned at most.")
    max_bytes: int = Field(8192, ge=256, le=16 * 1024 * 1024, description="Characters of rendered result kept.")
    allow_superuser: bool = Field(
        False, description="PostgreSQL: allow connecting as a superuser (read-only transactions do not stop them)."
    )


class HttpConfig(BaseModel):
    """SSRF-safe HTTP fetches."""

    model_config = ConfigDict(extra="forbid")

    allowed_schemes: tuple[str, ...] = Field(("https", "http"), description="URL schemes allowed.")
    allowed_hosts: tuple[str, ...] = Field(
        (), description="Host names allowed ('*.example.org' matches subdomains); empty allows any host."
    )
    allowed_ports: tuple[int, ...] = Field((80, 443), description="Ports allowed; empty allows any port.")
    allowed_private_networks: tuple[str, ...] = Field(
        (), description="CIDRs exempt from the non-global block (e.g. a local test site); empty in production."
    )
    max_redirects: int = Field(3, ge=0, le=20, description="Redirect hops followed, each re-validated.")
    max_bytes: int = Field(262_144, ge=1024, le=64 * 1024 * 1024, description="Response body bytes read at most.")
    timeout_s: float = Field(5.0, gt=0, le=120, description="Total time per fetch, redirects included.")
    max_text_chars: int = Field(4000, ge=100, le=1_000_000, description="Characters of text shown to the model.")


class BrowserConfig(BaseModel):
    """Headless Chromium via Playwright."""

    model_config = ConfigDict(extra="forbid")

    executable: str = Field("/usr/bin/chromium", description="Chromium binary (Debian's `chromium` package).")
    allowed_origins: tuple[str, ...] = Field(
        (), description="Origins ('http://127.0.0.1:8000') pages may load from; everything else is aborted."
    )
    timeout_s: float = Field(10.0, gt=0, le=120, description="Navigation/action timeout.")
    launch_timeout_s: float = Field(
        60.0,
        gt=0,
        le=600,
        description="Browser start timeout; a cold first launch builds font and profile caches (> 10 s on busy CI).",
    )
    max_text_chars: int = Field(4000, ge=100, le=1_000_000, description="Characters of page text shown to the model.")


class LoopConfig(BaseModel):
    """The server-side tool loop."""

    model_config = ConfigDict(extra="forbid")

    max_tool_calls: int = Field(
        8, ge=0, le=256, description="Tool calls executed per episode at most; malformed calls use up this budget too."
    )
    max_calls_per_turn: int = Field(4, ge=1, le=64, description="Tool calls executed from one model turn at most.")


class EnvHubConfig(BaseModel):
    """The env hub: connectors' guards, the tool loop bound and the ready environments' data."""

    model_config = ConfigDict(extra="forbid")

    sql_qa_db: str = Field("", description="SQLite file of the sql-qa env; empty = the bundled envhub/data db.")
    tasks_dir: str = Field(
        "", description="Directory of <env>.json task files replacing the bundled envhub/data/tasks ones."
    )
    web_site_url: str = Field(
        "http://127.0.0.1:8765/", description="Base URL of the site the web-lookup env reads (the local test site)."
    )

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Code sandbox.")
    sql: SqlConfig = Field(default_factory=SqlConfig, description="Read-only SQL.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="SSRF-safe HTTP.")
    browser: BrowserConfig = Field(default_factory=BrowserConfig, description="Headless browser.")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Server-side tool loop.")
