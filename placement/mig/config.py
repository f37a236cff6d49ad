"""Fleet and model files (YAML/JSON) as pydantic models, and the placer's tunables.

Invariant: a file either loads into a fully validated object or raises exactly one
``core.errors.InvalidArgument`` whose message names the file, the field path
(``nodes[1].gpu``) and the offending value. Validation is complete at load time: GPU types
exist in the catalog, MIG layouts are valid geometries of their GPU, model configs resolve
and parse, so the solver never meets a bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import InvalidArgument
from placement.mig.catalog import GPU_TYPES, gpu_type, place_layout
from placement.mig.memory import DTYPE_BYTES, ModelArch, load_config_json

_STRICT = ConfigDict(extra="forbid", frozen=True)


class NodeSpec(BaseModel):
    """One node's GPUs (all of one type)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=253, description="node name (the Kubernetes node / hostname)")
    gpu: str = Field(description=f"GPU type: one of {', '.join(GPU_TYPES)} (or an NVML device name)")
    count: int = Field(1, ge=1, le=64, description="number of GPUs of this type on the node")
    reconfigurable: bool = Field(
        True, description="whether the placer may change MIG modes/layouts here (false: keep mig_layouts as they are)"
    )
    mig_layouts: dict[int, list[str]] = Field(
        default_factory=dict, description="current MIG layout per GPU index, as profile names (e.g. [3g.40gb, 1g.10gb])"
    )
    profile_memory_mib: dict[str, int] = Field(
        default_factory=dict, description="measured memorySizeMB per MIG profile, replacing the catalog estimate"
    )
    total_memory_mib: int | None = Field(None, ge=1024, description="measured whole-GPU memory, MiB")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        try:
            return gpu_type(v).name
        except KeyError:
            raise ValueError(f"unknown GPU type {v!r} (known: {', '.join(GPU_TYPES)})") from None

    @model_validator(mode="after")
    def _valid_layouts(self) -> NodeSpec:
        gt = GPU_TYPES[self.gpu]
        for idx, layout in self.mig_layouts.items():
            if not 0 <= idx < self.count:
                raise ValueError(f"mig_layouts has GPU index {idx}, the node has GPUs 0..{self.count - 1}")
            names = {p.name for p in gt.profiles}
            for prof in layout:
                if prof not in names:
                    raise ValueError(
                        f"mig_layouts[{idx}]: {prof!r} is not a {self.gpu} MIG profile ({', '.join(names)})"
                    )
            if place_layout(gt, layout) is None:
                raise ValueError(f"mig_layouts[{idx}]: {layout} is not a valid {self.gpu} MIG geometry")
        for prof, mib in self.profile_memory_mib.items():
            if prof not in {p.name for p in gt.profiles}:
                raise ValueError(f"profile_memory_mib: {prof!r} is not a {self.gpu} MIG profile")
            if mib < 1024:
                raise ValueError(f"profile_memory_mib[{prof}]: {mib} MiB is too small")
        return self


class FleetFile(BaseModel):
    model_config = _STRICT

    nodes: list[NodeSpec] = Field(min_length=1, description="the fleet's nodes")

    @model_validator(mode="after")
    def _unique_names(self) -> FleetFile:
        seen: set[str] = set()
        for n in self.nodes:
            if n.name in seen:
                raise ValueError(f"node name {n.name!r} appears twice")
            seen.add(n.name)
        return self

    @property
    def gpu_count(self) -> int:
        return sum(n.count for n in self.nodes)


class DemandSpec(BaseModel):
    model_config = _STRICT

    tokens_per_s: float = Field(gt=0, le=1e9, description="generated tokens per second to serve")
    context_len: int = Field(4096, ge=16, le=2_097_152, description="longest sequence (prompt + output), tokens")
    avg_context_len: int | None = Field(
        None, ge=1, description="mean tokens in a sequence's KV while decoding (default: context_len / 2)"
    )
    itl_ms: float | None = Field(None, gt=0, le=10_000, description="SLO: max inter-token latency of a replica, ms")


class ModelSpec(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=200, description="served model name (also its engine --model)")
    model_path: str | None = Field(None, max_length=4096, description="weights directory or hub id (default: name)")
    config: str | dict[str, Any] = Field(
        description="config.json: a path (relative to the models file), a bundled name, or the fields inline"
    )
    weight_dtype: str = Field("bf16", description="weights dtype/quantisation: bf16, fp16, fp8, int8, int4, fp32")
    kv_cache_dtype: str = Field("auto", description="KV cache dtype: auto (= weights' compute dtype), fp8, bf16 ...")
    engine: Literal["vllm", "sglang"] = Field("vllm", description="engine that serves the replicas")
    demand: DemandSpec = Field(description="what to serve")
    weight: float = Field(1.0, gt=0, le=1000, description="priority: value of one served token/s of this model")
    block_size: int = Field(16, ge=1, le=1024, description="engine KV block size, tokens")
    max_num_seqs: int = Field(256, ge=1, le=65536, description="engine cap on concurrent sequences")
    max_num_batched_tokens: int = Field(8192, ge=16, le=1_048_576, description="engine cap on tokens per step")
    gpu_memory_utilization: float = Field(0.9, gt=0.1, le=0.99, description="fraction of device memory vLLM takes")
    activation_gib: float | None = Field(
        None, ge=0, le=1024, description="activation + runtime reserve (default: estimate)"
    )
    max_tp: int = Field(8, ge=1, le=8, description="largest tensor-parallel group over whole GPUs of one node")

    @field_validator("weight_dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v.lower() not in DTYPE_BYTES:
            raise ValueError(f"unknown weight_dtype {v!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
        return v.lower()

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_dtype(cls, v: str) -> str:
        if v.lower() != "auto" and v.lower() not in DTYPE_BYTES:
            raise ValueError(f"unknown kv_cache_dtype {v!r} (auto or one of {', '.join(sorted(DTYPE_BYTES))})")
        return v.lower()

    def kv_dtype(self) -> str:
        return "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


class ModelsFile(BaseModel):
    model_config = _STRICT

    models: list[ModelSpec] = Field(min_length=1, description="models to place, with their demand")

    @model_validator(mode="after")
    def _unique_names(self) -> ModelsFile:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model name {sorted(dup)[0]!r} appears twice")
        return self


class PerfModel(BaseModel):
    """Tunables of the analytical decode-throughput model (see docs/placement.md)."""

    model_config = _STRICT

    bandwidth_efficiency: float = Field(0.75, gt=0, le=1, description="achieved fraction of HBM bandwidth in decode")
    mfu: float = Field(0.4, gt=0, le=1, description="achieved fraction of dense bf16 FLOP/s")
    step_overhead_ms: float = Field(1.0, ge=0, le=100, description="fixed time per decode step (scheduler, launch)")
    tp_efficiency: float = Field(0.85, gt=0, le=1, description="throughput kept per tensor-parallel doubling")


class PlannerOptions(BaseModel):
    model_config = _STRICT

    solver: Literal["exact", "heuristic"] = Field("exact", description="ILP (HiGHS) or the greedy heuristic")
    time_limit_s: float = Field(60.0, gt=0, le=3600, description="HiGHS time limit per stage")
    allow_whole_gpu: bool = Field(True, description="whether GPUs may run with MIG disabled (whole-GPU replicas)")
    allow_mig: bool = Field(True, description="whether GPUs may be partitioned (false: the whole-GPU baseline)")
    perf: PerfModel = Field(default_factory=PerfModel, description="throughput model tunables")


# ---- loading ----------------------------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _first_error(path: Path, exc: ValidationError) -> InvalidArgument:
    errs = exc.errors()
    e = errs[0]
    loc = _loc(tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-after"))))
    msg = e["msg"].removeprefix("Value error, ")
    more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    value = e.get("input")
    shown = "" if isinstance(value, dict | list) or e["type"] == "missing" else f" (value: {value!r})"
    return InvalidArgument(f"{path}: {loc or '<top level>'}: {msg}{shown}{more}")


def _read(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{path}: not valid YAML/JSON: {exc}") from None


def load_fleet(path: str | Path) -> FleetFile:
    path = Path(path)
    try:
        return FleetFile.model_validate(_read(path))
    except ValidationError as exc:
        raise _first_error(path, exc) from None


def load_models(path: str | Path) -> tuple[ModelsFile, dict[str, ModelArch]]:
    """The models file and each model's parsed architecture (config paths resolve beside the file)."""
    path = Path(path)
    try:
        mf = ModelsFile.model_validate(_read(path))
    except ValidationError as exc:
        raise _first_error(path, exc) from None
    archs: dict[str, ModelArch] = {}
    for i, m in enumerate(mf.models):
        try:
            cfg = m.config if isinstance(m.config, dict) else load_config_json(m.config, path.parent)
            archs[m.name] = ModelArch.from_config(cfg)
        except (OSError, ValueError, TypeError) as exc:
            shown = m.config if isinstance(m.config, str) else "<inline>"
            raise InvalidArgument(f"{path}: models[{i}].config: {exc} (value: {shown!r})") from None
    return mf, archs
