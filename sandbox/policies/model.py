"""The sandbox policy schema: what a sandboxed run may reach, declared as data.

Every field maps onto a mechanism the code sandbox (``sandbox.runner``) already has:

==========================  =================================================================
``network.mode: none``      bubblewrap's ``--unshare-all`` (a network namespace with no interface)
``filesystem.read_only``    ``--ro-bind PATH PATH`` (host path, same place, read-only)
``filesystem.read_write``   ``--bind PATH PATH`` (host path, writable: declare it on purpose)
``filesystem.tmpfs``        ``--size N --tmpfs PATH`` (private, size-capped, gone after the run)
``filesystem.workdir``      ``--chdir`` and ``HOME``; must be one of the writable mounts
``limits.*``                hard rlimits set before the code runs (CPU, AS, NPROC, FSIZE, NOFILE)
                            and the parent's wall-clock kill of the process group
``syscalls.deny``           the seccomp-BPF deny list handed to ``bwrap --seccomp`` (x86_64)
==========================  =================================================================

What the sandbox cannot enforce is refused when the policy is validated, never ignored: a host
allowlist (the sandbox has no egress path to filter) and a default-deny syscall profile (the BPF
builder knows the numbers of its deny table only). Every error names its field
(``limits.cpu_s``, ``syscalls.deny.3``).

Invariant: a validated policy is frozen and its ``digest()`` (SHA-256 of its canonical JSON) is
the identity signed into verdicts; two policies with the same digest run code identically.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from core.canonical import canonical_json
from sandbox.seccomp import DENIED_X86_64

_HOST = re.compile(r"^(\*\.)?[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
_PROVIDED = ("/proc", "/dev")  # the sandbox mounts its own


def _abs_path(value: str) -> str:
    if not value.startswith("/") or os.path.normpath(value) != value or "/../" in f"{value}/":
        raise ValueError(f"{value!r} is not an absolute, normalised path")
    if value == "/":
        raise ValueError("'/' cannot be mounted: the sandbox root is an empty, read-only tmpfs")
    if any(value == p or value.startswith(p + "/") for p in _PROVIDED):
        raise ValueError(f"{value!r} is provided by the sandbox itself (its own /proc and /dev)")
    return value


def _host(value: str) -> str:
    if not _HOST.match(value):
        raise ValueError(f"{value!r} is not a host name ('example.org' or '*.example.org')")
    return value


AbsPath = Annotated[str, AfterValidator(_abs_path)]


def _refused(value: str, why: str) -> AfterValidator:
    """Refuse ``value`` of a schema field the sandbox cannot enforce (declared for the schema's future)."""

    def check(given: str) -> str:
        if given == value:
            raise ValueError(f"{value!r} {why}")
        return given

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NetworkPolicy(_Strict):
    """Where the code may connect."""

    mode: Annotated[
        Literal["none", "allowlist"],
        _refused(
            "allowlist",
            "cannot be enforced by the bubblewrap sandbox (its network namespace has no interface and no egress "
            "proxy to filter hosts); use 'none', or fetch through the env's HTTP connector",
        ),
    ] = Field(
        description="'none': a network namespace with no interface (no egress, no loopback service of the host); "
        "'allowlist': only ``hosts`` (refused: the bubblewrap sandbox has no egress path to filter)."
    )
    hosts: tuple[Annotated[str, AfterValidator(_host)], ...] = Field(
        (), max_length=256, description="Host names reachable under 'allowlist'; must be empty under 'none'."
    )

    @field_validator("hosts")
    @classmethod
    def _hosts_need_allowlist(cls, hosts: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if hosts and info.data.get("mode") == "none":
            raise ValueError("must be empty when mode is 'none'")
        return hosts


class TmpfsMount(_Strict):
    """A private, size-capped tmpfs inside the sandbox."""

    path: AbsPath = Field(description="Where it is mounted (absolute; not '/', /proc or /dev).")
    size_mb: int = Field(ge=1, le=4096, description="Its size cap in MiB (1..4096); writes past it fail ENOSPC.")


class FilesystemPolicy(_Strict):
    """What the sandbox sees of the host's files; everything not listed does not exist inside."""

    read_only: tuple[AbsPath, ...] = Field(
        min_length=1, max_length=64, description="Host paths bound read-only at the same place; must include /usr."
    )
    read_write: tuple[AbsPath, ...] = Field(
        (), max_length=64, description="Host paths bound writable at the same place (writes reach the host)."
    )
    tmpfs: tuple[TmpfsMount, ...] = Field(max_length=16, description="Private size-capped tmpfs mounts.")
    workdir: AbsPath = Field(description="The code's working directory and HOME: one of the writable mounts.")

    @field_validator("read_only")
    @classmethod
    def _needs_usr(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        if "/usr" not in paths:
            raise ValueError("must include /usr (the sandbox's interpreter and libraries live there)")
        _no_duplicates(paths, ())
        return paths

    @field_validator("read_write")
    @classmethod
    def _rw_unique(cls, paths: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        _no_duplicates(paths, info.data.get("read_only", ()))
        return paths

    @field_validator("tmpfs")
    @classmethod
    def _tmpfs_unique(cls, mounts: tuple[TmpfsMount, ...], info: ValidationInfo) -> tuple[TmpfsMount, ...]:
        _no_duplicates(
            tuple(m.path for m in mounts), (*info.data.get("read_only", ()), *info.data.get("read_write", ()))
        )
        return mounts

    @field_validator("workdir")
    @classmethod
    def _workdir_writable(cls, workdir: str, info: ValidationInfo) -> str:
        writable = (*info.data.get("read_write", ()), *(m.path for m in info.data.get("tmpfs", ())))
        if workdir not in writable:
            raise ValueError(f"{workdir!r} must be one of the tmpfs or read_write mounts ({', '.join(writable)})")
        return workdir


def _no_duplicates(paths: tuple[str, ...], earlier: tuple[str, ...]) -> None:
    seen = set(earlier)
    for p in paths:
        if p in seen:
            raise ValueError(f"{p!r} is mounted twice")
        seen.add(p)


class LimitsPolicy(_Strict):
    """Per-run resource limits: hard rlimits (the code can only lower them) and the wall clock."""

    cpu_s: int = Field(ge=1, le=600, description="RLIMIT_CPU in seconds (1..600); SIGXCPU past it.")
    wall_s: float = Field(gt=0, le=600, description="Wall-clock seconds (0..600]; the process group is killed.")
    memory_mb: int = Field(ge=32, le=65536, description="RLIMIT_AS in MiB per process (32..65536).")
    pids: int = Field(
        ge=1, le=4096, description="RLIMIT_NPROC (1..4096), bubblewrap's init included: pids - 1 tasks for the code."
    )
    file_size_mb: int = Field(ge=1, le=4096, description="RLIMIT_FSIZE in MiB (1..4096): the largest file written.")
    open_files: int = Field(ge=8, le=65536, description="RLIMIT_NOFILE (8..65536).")


class SyscallPolicy(_Strict):
    """The seccomp profile: allow everything except ``deny`` (x86_64)."""

    default: Annotated[
        Literal["allow", "deny"],
        _refused(
            "deny",
            "(an allowlist profile) cannot be enforced: the seccomp builder knows the syscall numbers of its deny "
            "table only; use default 'allow' with a deny list",
        ),
    ] = Field(
        description="'allow' with a deny list; 'deny' with an allow list is refused (the BPF builder knows the "
        "numbers of its deny table only)."
    )
    deny: tuple[str, ...] = Field(
        max_length=len(DENIED_X86_64),
        description="Syscalls failing with EPERM, from sandbox.seccomp.DENIED_X86_64; empty = no filter.",
    )
    allow: tuple[str, ...] = Field((), max_length=512, description="Only under default 'deny' (refused today).")

    @field_validator("deny")
    @classmethod
    def _known(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if name not in DENIED_X86_64:
                raise ValueError(f"unknown syscall {name!r}; the deny table has: {', '.join(sorted(DENIED_X86_64))}")
        if len(set(names)) != len(names):
            raise ValueError("lists a syscall twice")
        return names

    @field_validator("allow")
    @classmethod
    def _allow_needs_deny_default(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if names:
            raise ValueError("must be empty when default is 'allow' (everything not denied is allowed)")
        return names


class SandboxPolicy(_Strict):
    """A declared sandbox policy (one YAML file in ``sandbox/policies/``)."""

    version: Literal[1] = Field(description="Schema version of the policy file (1).")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$", description="Policy name (the file's stem if shipped).")
    description: str = Field("", max_length=1000, description="What the policy is for.")
    network: NetworkPolicy = Field(description="Network reach.")
    filesystem: FilesystemPolicy = Field(description="Mounts.")
    limits: LimitsPolicy = Field(description="Resource limits.")
    syscalls: SyscallPolicy = Field(description="Seccomp profile.")

    def digest(self) -> str:
        """``sha256:<hex>`` of the canonical JSON (``core.canonical``) of the validated policy (a verdict signs it)."""
        return "sha256:" + hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()
