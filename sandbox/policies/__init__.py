"""Sandbox policies: declared, validated, digested (schema in ``model.py``).

A policy is referenced by the name of a shipped file (``default``, ``grader``: the YAML files next to this
module, package data) or by the path of a YAML file. ``load_policy`` validates it and raises
``InvalidArgument`` naming the source and the field (``grader.yaml: limits.cpu_s: ...``). Shipped policies
are loaded once per process.

Envs declare theirs (``ToolEnvironment.sandbox_policy``), graders theirs (``sandbox_policy`` attribute,
default ``grader``); the verifier signs ``policy_digest(...)`` of the grader's into each verdict.
``under_config`` lays the limits an operator set explicitly in ``[envhub.sandbox]`` over a declared policy,
so the digest always names what actually runs.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from core.errors import InvalidArgument
from sandbox.config import SandboxConfig
from sandbox.policies.model import (
    FilesystemPolicy,
    LimitsPolicy,
    NetworkPolicy,
    SandboxPolicy,
    SyscallPolicy,
    TmpfsMount,
)

DEFAULT_GRADER_POLICY = "grader"

# SandboxConfig field -> LimitsPolicy field.
_CONFIG_LIMITS = {
    "cpu_s": "cpu_s",
    "wall_s": "wall_s",
    "memory_mb": "memory_mb",
    "max_processes": "pids",
    "max_file_mb": "file_size_mb",
    "max_open_files": "open_files",
}


def shipped_policies() -> tuple[str, ...]:
    """Names of the policies shipped with the package."""
    files = resources.files(__name__).iterdir()
    return tuple(sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml")))


def parse_policy(data: Any, source: str) -> SandboxPolicy:
    """Validate a parsed YAML document; errors name ``source`` and each bad field."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: a policy is a mapping (version, name, network, filesystem, limits, syscalls)")
    try:
        return SandboxPolicy.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(policy)"
            got = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
            lines.append(f"{source}: {field}: {err['msg'].removeprefix('Value error, ')}{got}")
        raise InvalidArgument("\n".join(lines)) from None


@functools.cache
def _shipped(name: str) -> SandboxPolicy:
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text()
    policy = parse_policy(yaml.safe_load(text), f"{name}.yaml")
    if policy.name != name:
        raise InvalidArgument(f"{name}.yaml: name: {policy.name!r} is not the file's stem {name!r}")
    return policy


def load_policy(ref: str | Path) -> SandboxPolicy:
    """The policy ``ref`` names: a shipped policy's name, or a YAML file's path."""
    if isinstance(ref, str) and ref in shipped_policies():
        return _shipped(ref)
    path = Path(ref)
    if not path.is_file():
        raise InvalidArgument(f"sandbox policy {str(ref)!r}: no such file, nor a shipped policy ({shipped_names()})")
    try:
        data = yaml.safe_load(path.read_bytes())  # bytes: PyYAML detects the encoding, rejects bad bytes
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not valid YAML: {exc}") from None
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot be read: {exc.strerror}") from None
    return parse_policy(data, str(path))


def shipped_names() -> str:
    return ", ".join(shipped_policies())


def policy_digest(ref: str | SandboxPolicy) -> str:
    """The digest of a policy or of the one ``ref`` names (shipped ones computed once)."""
    if isinstance(ref, SandboxPolicy):
        return ref.digest()
    return _shipped_digest(ref) if ref in shipped_policies() else load_policy(ref).digest()


@functools.cache
def _shipped_digest(name: str) -> str:
    return _shipped(name).digest()


def under_config(policy: SandboxPolicy, config: SandboxConfig) -> SandboxPolicy:
    """``policy`` with what the operator set explicitly in ``[envhub.sandbox]`` on top: the limits
    (``cpu_s`` ... ``max_open_files``), ``workdir_mb`` (every tmpfs size) and ``seccomp = false`` (no
    deny list). Fields left at their defaults defer to the policy."""
    given = config.model_fields_set
    data = policy.model_dump()
    for cfg, lim in _CONFIG_LIMITS.items():
        if cfg in given:
            data["limits"][lim] = getattr(config, cfg)
    if "workdir_mb" in given:
        for mount in data["filesystem"]["tmpfs"]:
            mount["size_mb"] = config.workdir_mb
    if "seccomp" in given and not config.seccomp:
        data["syscalls"]["deny"] = ()
    if data == policy.model_dump():
        return policy
    return parse_policy(data, f"{policy.name} under [envhub.sandbox]")


__all__ = [
    "DEFAULT_GRADER_POLICY",
    "FilesystemPolicy",
    "LimitsPolicy",
    "NetworkPolicy",
    "SandboxPolicy",
    "SyscallPolicy",
    "TmpfsMount",
    "load_policy",
    "parse_policy",
    "policy_digest",
    "shipped_policies",
    "under_config",
]
