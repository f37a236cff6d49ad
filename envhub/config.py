"""Configuration of the env hub (the ``envhub`` section of the settings root).

Every guard has a safe default: the sandbox refuses to run without bubblewrap, SQL is
read-only with deadlines and caps, HTTP blocks every non-global address, the browser only
opens allowlisted origins.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SandboxConfig(BaseModel):
    """The code sandbox: one fresh process per call under bubblewrap plus rlimits."""

    model_config = ConfigDict(extra="forbid")

    isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="Isolation layer; 'none' runs with rlimits only and needs allow_unisolated=true."
    )
    allow_unisolated: bool = Field(
        False, description="Explicit opt-in to run code without an isolation layer (trusted code only)."
    )
    bwrap_path: str = Field("/usr/bin/bwrap", description="bubblewrap binary.")
    seccomp: bool = Field(
        True, description="Load the seccomp deny list (ptrace, mount, bpf, keyctl, ...) into the sandbox (x86_64)."
    )
    python: str = Field(
        "",
        description="Interpreter run inside the sandbox (must live under /usr); empty = the hub's own interpreter "
        "when it lives under /usr (e.g. /usr/local/bin/python3 in the python:*-slim image), else /usr/bin/python3.",
    )
    probe_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Deadline of the one-off check that bubblewrap works here."
    )
    run_as_uid: int = Field(
        65534,
        ge=1,
        description="When the hub runs as root, drop to this uid/gid before bwrap (root is exempt from RLIMIT_NPROC).",
    )
    wall_s: float = Field(5.0, gt=0, le=600, description="Wall-clock limit; the process group is killed after it.")
    cpu_s: int = Field(3, ge=1, le=600, description="RLIMIT_CPU in seconds.")
    memory_mb: int = Field(
        256,
        ge=32,
        le=65536,
        description="RLIMIT_AS in MiB, per process: the code's total is up to (max_processes - 1) x this.",
    )
    max_file_mb: int = Field(8, ge=1, le=4096, description="RLIMIT_FSIZE in MiB (largest file the code may write).")
    workdir_mb: int = Field(16, ge=1, le=4096, description="Size of the tmpfs work directory in MiB.")
    max_processes: int = Field(
        2,
        ge=1,
        le=4096,
        description="RLIMIT_NPROC (processes and threads, bubblewrap's init included): the code may run "
        "max_processes - 1 tasks, so the default 2 (no fork, no threads) caps its memory at memory_mb.",
    )
    max_open_files: int = Field(64, ge=8, le=65536, description="RLIMIT_NOFILE.")
    max_output_bytes: int = Field(
        16_384, ge=256, le=16 * 1024 * 1024, description="stdout+stderr kept; more kills the process."
    )


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
