"""Configuration of the code sandbox (``[envhub.sandbox]`` in the settings: the env hub's code tools run here).

Every guard has a safe default: the sandbox refuses to run without bubblewrap unless told otherwise.
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
