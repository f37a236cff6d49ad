"""The bridge's replica list of a placement plan, and reading it back from a plan file.

``primerl placement plan --output FILE`` writes ``bridge_replicas``: one entry per engine
replica with its KV capacity in tokens. The router reads it (``routing.plan_file``) so the
prefix index believes a replica holds at most what its KV budget can hold. Only the standard
library and PyYAML here: the bridge reads a plan without importing the solver.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from core.errors import InvalidArgument


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One engine replica as the bridge's router and cache index see it."""

    id: str
    model: str
    url: str
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int


def load_endpoints(path: str | Path) -> list[ReplicaEndpoint]:
    """The ``bridge_replicas`` of a plan file (JSON or YAML); InvalidArgument names what is wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"placement plan {str(path)!r} cannot be read: {exc}") from None
    entries = data.get("bridge_replicas") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise InvalidArgument(
            f"placement plan {str(path)!r} has no bridge_replicas list (write it with primerl placement plan --output)"
        )
    names = [f.name for f in fields(ReplicaEndpoint)]
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or any(n not in e for n in names):
            raise InvalidArgument(f"placement plan {str(path)!r}: bridge_replicas[{i}] needs the fields {names}")
        try:
            out.append(ReplicaEndpoint(**{n: type_(e[n]) for n, type_ in _TYPES.items()}))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"placement plan {str(path)!r}: bridge_replicas[{i}]: {exc}") from None
    return out


_TYPES = {"id": str, "model": str, "url": str, "kv_capacity_tokens": int, "block_size": int, "max_num_seqs": int}
