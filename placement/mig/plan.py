"""A placement plan and what it renders to: YAML/JSON, engine launch commands, Helm values,
the mig-parted config per node, the bridge's replica list, and a readable table.

Invariants: every replica has exactly one device (one MIG slice, or ``tp`` whole GPUs of
one node); its engine flags realise the KV budget the placer assumed
(``--kv-cache-memory-bytes`` is the exact budget); the replica list carries each replica's
KV capacity in tokens, which bounds what the cache index may believe a replica holds.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import yaml

from placement.mig.catalog import GPU_TYPES, SOURCE_NOTE
from placement.mig.config import ModelSpec
from placement.mig.endpoints import ReplicaEndpoint
from placement.mig.problem import Problem, Replica, Solution

BASE_PORT = 8000


def _rid(r: Replica) -> str:
    where = f"{r.node}-g{'-'.join(map(str, r.gpu_indices))}"
    dev = f"{r.profile}-s{r.start}" if r.profile else (f"tp{len(r.gpu_indices)}" if len(r.gpu_indices) > 1 else "whole")
    return _slug(f"{r.model}-{where}-{dev}")


def _device_env(r: Replica) -> str:
    if r.profile:
        # Only the MIG UUID identifies a slice; it exists once the instance is created. vLLM
        # mis-parsed MIG UUIDs in CUDA_VISIBLE_DEVICES (#6551): in containers expose one slice as device 0.
        return f"CUDA_VISIBLE_DEVICES=<MIG-uuid of {r.node} gpu {r.gpu_indices[0]} {r.profile}@{r.start}>"
    return "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, r.gpu_indices))


def budget_flags(spec: ModelSpec, r: Replica) -> list[str]:
    """The engine flags that realise the replica's KV budget (and its TP degree)."""
    tp = len(r.gpu_indices)
    b = r.perf.budget
    seqs = max(1, min(spec.max_num_seqs, b.max_concurrent_seqs))
    if spec.engine == "sglang":
        flags = [
            "--mem-fraction-static",
            f"{spec.gpu_memory_utilization:g}",
            "--max-running-requests",
            str(seqs),
            "--context-length",
            str(b.max_model_len),
            "--page-size",
            str(b.block_size),
        ]
        return [*flags, "--tp", str(tp)] if tp > 1 else flags
    return b.engine_flags(seqs, tp)


def launch_argv(spec: ModelSpec, r: Replica, port: int) -> list[str]:
    """The engine's launch profile (``engines.launch``: the flags RL needs) plus the budget flags."""
    from engines.launch import sglang_command, vllm_command

    base = sglang_command if spec.engine == "sglang" else vllm_command
    return [*base(spec.model_path or spec.name, port, spec.name), *budget_flags(spec, r)]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def _chart_args(spec: ModelSpec, r: Replica) -> list[str]:
    """The chart's engine ``args`` for a replica: vLLM's image runs the API server, so its flags only
    (``VLLM_SERVER_DEV_MODE`` is the chart's env); the other images get the whole command."""
    argv = launch_argv(spec, r, BASE_PORT)
    if spec.engine != "vllm":
        return argv
    model = spec.model_path or spec.name
    return [f"--model={model}", *argv[argv.index(model) + 1 :]]


def launch_command(spec: ModelSpec, r: Replica, port: int) -> str:
    return f"{_device_env(r)} {shlex.join(launch_argv(spec, r, port))}"


class Plan:
    def __init__(self, prob: Problem, sol: Solution) -> None:
        self.prob = prob
        self.sol = sol
        self.specs = prob.specs
        ports: Counter[str] = Counter()
        self.ports: dict[int, int] = {}
        for i, r in enumerate(sol.replicas):
            self.ports[i] = BASE_PORT + ports[r.node]
            ports[r.node] += 1

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [
            ReplicaEndpoint(
                _rid(r),
                r.model,
                f"http://{r.node}:{self.ports[i]}",
                r.perf.budget.kv_tokens,
                r.perf.budget.block_size,
                max(1, min(self.specs[r.model].max_num_seqs, r.perf.budget.max_concurrent_seqs)),
            )
            for i, r in enumerate(self.sol.replicas)
        ]

    def mig_parted_config(self) -> dict[str, Any]:
        """A mig-parted config: one named layout per node (apply with label nvidia.com/mig.config)."""
        configs: dict[str, list[dict[str, Any]]] = {}
        by_node: dict[str, list[Any]] = defaultdict(list)
        for g in self.sol.gpus:
            by_node[g.node].append(g)
        for node, gpus in sorted(by_node.items()):
            entries: dict[tuple[bool, tuple[tuple[str, int], ...]], list[int]] = defaultdict(list)
            for g in gpus:
                layout = tuple(sorted(Counter(p for p, _ in g.placements).items()))
                entries[(g.mig, layout)].append(g.index)
            configs[f"primerl-{node}"] = [
                {"devices": idx, "mig-enabled": mig, **({"mig-devices": dict(layout)} if mig else {})}
                for (mig, layout), idx in sorted(entries.items())
            ]
        return {"version": "v1", "mig-configs": configs}

    def helm_values(self) -> dict[str, dict[str, Any]]:
        """Values for k8s/HelmChart, one release per (model, device): ``{release name: values}``.

        The chart runs one engine pool per engine type with one device per replica (a GPU count or a
        MIG profile) and one model per bridge, so a plan with several models or device shapes is
        several releases (``helm install NAME k8s/HelmChart -f`` each). Only keys the chart reads:
        ``bridge.engine.{type,model}``, ``engines.<type>.{enabled,replicas,port,gpu,args,nodeSelector}``
        (vLLM's image takes flags as ``args``; the others' ``args`` are the whole command).
        """
        shapes: dict[tuple[str, str | None, int], list[Replica]] = defaultdict(list)
        for r in self.sol.replicas:
            shapes[(r.model, r.profile, len(r.gpu_indices))].append(r)
        out: dict[str, dict[str, Any]] = {}
        for (model, profile, tp), reps in shapes.items():
            spec = self.specs[model]
            device = profile or (f"tp{tp}" if tp > 1 else "gpu")
            pool: dict[str, Any] = {
                "enabled": True,
                "replicas": len(reps),
                "port": BASE_PORT,
                "gpu": {"count": 0 if profile else tp, "migProfile": profile or ""},
                "args": _chart_args(spec, reps[0]),
            }
            nodes = {r.node for r in reps}
            if len(nodes) == 1:  # several nodes: the scheduler finds the slices (no one nodeSelector matches)
                pool["nodeSelector"] = {"kubernetes.io/hostname": nodes.pop()}
            engines = {t: {"enabled": False} for t in ("vllm", "sglang", "trtllm") if t != spec.engine}
            out[_slug(f"{model}-{device}")] = {
                "bridge": {"engine": {"type": spec.engine, "model": model}},
                "engines": {spec.engine: pool, **engines},
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        sol = self.sol
        reps = []
        for i, r in enumerate(sol.replicas):
            spec = self.specs[r.model]
            b = r.perf.budget
            reps.append(
                {
                    "id": _rid(r),
                    "model": r.model,
                    "node": r.node,
                    "gpus": list(r.gpu_indices),
                    "device": r.profile
                    or ("whole" if len(r.gpu_indices) == 1 else f"whole x{len(r.gpu_indices)} (TP)"),
                    "mig_start": r.start,
                    "memory_mib": r.perf.device.memory_mib,
                    "weights_gib": round(b.weights_bytes / 2**30, 2),
                    "kv_cache_bytes": b.kv_cache_bytes,
                    "kv_tokens": b.kv_tokens,
                    "max_concurrent_seqs": b.max_concurrent_seqs,
                    "batch": r.perf.batch,
                    "step_ms": round(r.perf.step_ms, 2),
                    "tokens_per_s": round(r.perf.tokens_per_s, 1),
                    "command": launch_command(spec, r, self.ports[i]),
                }
            )
        return {
            "solver": sol.solver,
            "status": sol.status,
            "solve_s": round(sol.solve_s, 4),
            "catalog_source": SOURCE_NOTE,
            "summary": {
                "demand_tokens_per_s": round(sum(sol.demand.values()), 1),
                "served_tokens_per_s": round(sum(sol.served.values()), 1),
                "served_fraction": round(sol.served_fraction, 4),
                "gpus_used": sol.gpus_used,
                "gpus_total": sol.gpus_total,
            },
            "models": [
                {
                    "name": m,
                    "demand_tokens_per_s": d,
                    "served_tokens_per_s": round(sol.served[m], 1),
                    "replicas": sum(1 for r in sol.replicas if r.model == m),
                }
                for m, d in sol.demand.items()
            ],
            "unserved": [
                {
                    "model": u.model,
                    "demand_tokens_per_s": u.demand,
                    "served_tokens_per_s": round(u.served, 1),
                    "shortfall_tokens_per_s": round(u.demand - u.served, 1),
                    "reason": u.reason,
                }
                for u in sol.unserved
            ],
            "gpus": [
                {
                    "node": g.node,
                    "index": g.index,
                    "type": g.gpu,
                    "mig": g.mig,
                    # Creation order: largest instances first (placement of small ones depends on them).
                    "placements": [
                        {"profile": p, "start": s}
                        for p, s in sorted(g.placements, key=lambda t: (-GPU_TYPES[g.gpu].profile(t[0]).size, t[1]))
                    ],
                }
                for g in sol.gpus
            ],
            "replicas": reps,
            "bridge_replicas": [e.__dict__ for e in self.endpoints()],
            "mig_parted": self.mig_parted_config(),
            "helm_values": self.helm_values(),
        }

    def dump(self, fmt: str = "yaml") -> str:
        data = self.to_dict()
        if fmt == "json":
            return json.dumps(data, indent=2) + "\n"
        return str(yaml.safe_dump(data, sort_keys=False, width=200))

    def table(self) -> str:
        sol = self.sol
        lines = [
            f"solver {sol.solver} ({sol.status}) in {sol.solve_s * 1e3:.1f} ms; "
            f"GPUs used {sol.gpus_used}/{sol.gpus_total}; served {sum(sol.served.values()):,.0f} of "
            f"{sum(sol.demand.values()):,.0f} tok/s ({100 * sol.served_fraction:.1f}%)",
            "",
        ]
        head = ("replica", "device", "KV tokens", "seqs", "ITL ms", "tok/s")
        rows = [
            (
                f"{r.model} @ {r.node}/{','.join(map(str, r.gpu_indices))}",
                f"{r.perf.device.gpu.name} "
                + (f"{r.profile}@{r.start}" if r.profile else f"whole x{len(r.gpu_indices)}"),
                f"{r.perf.budget.kv_tokens:,}",
                str(r.perf.batch),
                f"{r.perf.step_ms:.1f}",
                f"{r.perf.tokens_per_s:,.0f}",
            )
            for r in sol.replicas
        ]
        lines += _columns(head, rows)
        lines += [
            "",
            *_columns(
                ("model", "demand tok/s", "served tok/s", "served"),
                [
                    (m, f"{d:,.0f}", f"{sol.served[m]:,.0f}", f"{100 * sol.served[m] / d:.0f}%")
                    for m, d in sol.demand.items()
                ],
            ),
        ]
        for u in sol.unserved:
            lines.append(f"NOT SERVED {u.model}: {u.demand - u.served:,.0f} of {u.demand:,.0f} tok/s — {u.reason}")
        return "\n".join(lines)


def _columns(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
