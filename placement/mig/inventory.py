"""The fleet as it is: read through NVML (``pynvml`` from nvidia-ml-py), or from a fleet file.

Read-only by construction: only ``nvmlDeviceGet*`` / ``nvmlGpuInstanceGetInfo`` queries are
made; nothing here creates, destroys or reconfigures MIG instances or modes.

Without NVML (no package, no driver, no GPU: this project's CI machines) ``load_inventory``
says so in one line and uses the fleet file; with neither it raises ``FailedPrecondition``
telling the user to pass ``--fleet``. Memory is read on each MIG *device* handle
(``nvmlDeviceGetMemoryInfo(mig_handle)``): containers often cannot query the parent GPU.
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from core.errors import FailedPrecondition
from placement.mig.catalog import GPU_TYPES, gpu_type, place_layout
from placement.mig.config import FleetFile, NodeSpec, load_fleet

_PROFILE_CONSTS = (
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
)


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    compute_slices: int
    memory_mib: int
    start: int | None  # memory-slice start of its GPU instance, when NVML tells
    profile: str | None  # catalog profile name it matches


@dataclass
class GpuRecord:
    index: int
    name: str
    gpu_type: str | None  # catalog key, None for a GPU the catalog does not know
    total_mib: int | None
    mig_enabled: bool
    mig_pending: bool
    mig_devices: list[MigDevice] = field(default_factory=list)
    profile_memory_mib: dict[str, int] = field(default_factory=dict)  # from nvmlDeviceGetGpuInstanceProfileInfo
    remaining: dict[str, int] = field(default_factory=dict)  # instances of each profile that can still be created


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_module() -> tuple[ModuleType | None, str]:
    """The initialised ``pynvml`` module, or (None, why NVML cannot be used here)."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None, "NVML unavailable: the nvidia-ml-py package (module pynvml) is not installed"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc} (no NVIDIA driver or GPU on this machine)"
    return nvml, ""


def _match_profile(gpu: str | None, compute: int, memory_mib: int) -> str | None:
    if gpu is None:
        return None
    cands = [p for p in GPU_TYPES[gpu].placeable if p.compute == compute]
    return min(cands, key=lambda p: abs(p.memory_mib - memory_mib)).name if cands else None


def read_nvml(nvml: Any) -> list[GpuRecord]:
    """Every GPU, its MIG mode, MIG devices (real memorySizeMB) and remaining profile capacity."""
    err = nvml.NVMLError
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        name = _s(nvml.nvmlDeviceGetName(h))
        try:
            total: int | None = int(nvml.nvmlDeviceGetMemoryInfo(h).total) // 2**20
        except err:  # containers often may not query the parent GPU
            total = None
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(h)
        except err:  # not MIG-capable
            current = pending = 0
        try:
            key: str | None = gpu_type(name).name
        except KeyError:
            key = None
        rec = GpuRecord(i, name, key, total, current == 1, pending == 1)
        if rec.mig_enabled:
            for const in _PROFILE_CONSTS:
                if not hasattr(nvml, const):
                    continue
                try:
                    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, getattr(nvml, const))
                    left = nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id)
                except err:
                    continue
                prof = _match_profile(key, int(info.sliceCount), int(info.memorySizeMB))
                if prof and prof not in rec.profile_memory_mib:
                    rec.profile_memory_mib[prof] = int(info.memorySizeMB)
                    rec.remaining[prof] = int(left)
            for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                except err:  # NVMLError_NotFound: an empty slot
                    continue
                mem = int(nvml.nvmlDeviceGetMemoryInfo(mh).total) // 2**20
                attrs = nvml.nvmlDeviceGetAttributes(mh)
                start = None
                try:
                    gi = nvml.nvmlDeviceGetGpuInstanceById(h, nvml.nvmlDeviceGetGpuInstanceId(mh))
                    start = int(nvml.nvmlGpuInstanceGetInfo(gi).placement.start)
                except err:
                    pass
                g = int(attrs.gpuInstanceSliceCount)
                rec.mig_devices.append(
                    MigDevice(_s(nvml.nvmlDeviceGetUUID(mh)), g, mem, start, _match_profile(key, g, mem))
                )
        out.append(rec)
    return out


def fleet_from_records(records: list[GpuRecord], host: str) -> tuple[FleetFile, list[str]]:
    """A fleet (one node per GPU type on this host) and notes on what could not be used."""
    notes: list[str] = []
    by_type: dict[str, list[GpuRecord]] = {}
    for r in records:
        if r.gpu_type is None:
            notes.append(f"GPU {r.index} ({r.name}): not in the MIG catalog, left out")
            continue
        by_type.setdefault(r.gpu_type, []).append(r)
    nodes = []
    for t, recs in by_type.items():
        layouts: dict[int, list[str]] = {}
        mem: dict[str, int] = {}
        for pos, r in enumerate(recs):
            mem.update(r.profile_memory_mib)
            if r.mig_enabled and r.mig_devices:
                names = [d.profile for d in r.mig_devices]
                if None in names or place_layout(GPU_TYPES[t], [n for n in names if n]) is None:
                    notes.append(f"GPU {r.index}: MIG devices {names} do not match the catalog; layout not recorded")
                else:
                    layouts[pos] = [n for n in names if n]
        totals = [r.total_mib for r in recs if r.total_mib]
        nodes.append(
            NodeSpec(
                name=host if len(by_type) == 1 else f"{host}-{t.lower()}",
                gpu=t,
                count=len(recs),
                mig_layouts=layouts,
                profile_memory_mib=mem,
                total_memory_mib=min(totals) if totals else None,
            )
        )
    if not nodes:
        raise FailedPrecondition("NVML found no GPU the placer knows: " + "; ".join(notes or ["no GPUs"]))
    return FleetFile(nodes=nodes), notes


def load_inventory(fleet_file: str | Path | None = None) -> tuple[FleetFile, str, list[GpuRecord]]:
    """The fleet from NVML when it is available, else from ``fleet_file``; plus a one-line note."""
    nvml, why = nvml_module()
    if nvml is None:
        if fleet_file is None:
            raise FailedPrecondition(f"{why}; pass --fleet FLEET.yaml to describe the fleet")
        return load_fleet(fleet_file), f"{why}; using fleet file {fleet_file}", []
    try:
        records = read_nvml(nvml)
    finally:
        nvml.nvmlShutdown()
    fleet, notes = fleet_from_records(records, socket.gethostname())
    return fleet, "; ".join(["fleet read through NVML", *notes]), records
