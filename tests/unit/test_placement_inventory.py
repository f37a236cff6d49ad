"""NVML inventory: the fallback when NVML is absent (this machine), and the record -> fleet mapping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.errors import FailedPrecondition
from placement.mig.catalog import GPU_TYPES
from placement.mig.inventory import GpuRecord, MigDevice, fleet_from_records, load_inventory, nvml_module
from server.cli import main

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "examples/placement/fleet.yaml"

needs_no_nvml = pytest.mark.skipif(nvml_module()[0] is not None, reason="this machine has NVML (a GPU host)")


@needs_no_nvml
def test_without_a_driver_the_fallback_says_so_and_uses_the_file() -> None:
    nvml, why = nvml_module()
    assert nvml is None
    assert why.startswith("NVML unavailable:") and "no NVIDIA driver" in why
    fleet, note, records = load_inventory(FLEET)
    assert fleet.gpu_count == 14 and records == []
    assert note.startswith("NVML unavailable") and f"using fleet file {FLEET}" in note


@needs_no_nvml
def test_without_nvml_or_file_the_error_says_what_to_do() -> None:
    with pytest.raises(FailedPrecondition, match=r"pass --fleet FLEET\.yaml"):
        load_inventory(None)


def test_without_the_package_the_fallback_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what an environment without nvidia-ml-py looks like
    nvml, why = nvml_module()
    assert nvml is None and "nvidia-ml-py" in why
    _, note, _ = load_inventory(FLEET)
    assert "nvidia-ml-py" in note


@needs_no_nvml
def test_cli_inventory_and_plan_without_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["placement", "inventory", "--fleet", str(FLEET)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NVML unavailable") and "node hgx-h100-a: 8 x H100-80GB" in out
    assert main(["placement", "plan", "--models", str(REPO / "examples/placement/models.yaml")]) == 2
    assert "pass --fleet" in capsys.readouterr().err


def test_records_become_a_fleet_with_real_slice_memory() -> None:
    h200 = GpuRecord(
        0,
        "NVIDIA H200",
        "H200",
        143771,
        True,
        True,
        [
            MigDevice("MIG-a", 3, 69632, 4, "3g.71gb"),
            MigDevice("MIG-b", 1, 33280, 0, "1g.35gb"),
            MigDevice("MIG-c", 1, 33280, 2, "1g.35gb"),
        ],
        {"1g.35gb": 33280, "3g.71gb": 69632},
        {"1g.35gb": 0},
    )
    plain = GpuRecord(1, "NVIDIA H200", "H200", 143771, False, False)
    odd = GpuRecord(2, "NVIDIA GeForce RTX 4090", None, 24564, False, False)
    fleet, notes = fleet_from_records([h200, plain, odd], "host1")
    [node] = fleet.nodes
    assert node.name == "host1" and node.gpu == "H200" and node.count == 2
    assert sorted(node.mig_layouts[0]) == ["1g.35gb", "1g.35gb", "3g.71gb"]
    assert node.profile_memory_mib["1g.35gb"] == 33280
    assert node.total_memory_mib == 143771
    assert any("RTX 4090" in n for n in notes)
    assert GPU_TYPES[node.gpu].profile("3g.71gb").memory_mib != 69632  # the measured value wins over the estimate


def test_records_with_no_known_gpu_are_refused() -> None:
    with pytest.raises(FailedPrecondition, match="no GPU the placer knows"):
        fleet_from_records([GpuRecord(0, "Tesla T4", None, 15360, False, False)], "h")


class _FakeNvml:
    """A working stand-in for the pynvml calls ``read_nvml`` makes (no GPU here), following their
    documented behaviour: MIG slots raise NVMLError_NotFound when empty, sizes are MiB / bytes."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
    NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9

    class _Obj:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    def __init__(self) -> None:
        # GPU 0: H100 in MIG mode with 3g.40gb@4 and 1g.10gb@0, slot 1 empty; GPU 1: MIG off.
        self.mig = {("g0", 0): ("MIG-x", 3, 40192, 1, 4), ("g0", 2): ("MIG-y", 1, 9984, 2, 0)}
        self.profiles = {0: (19, 1, 9984), 2: (9, 3, 40192), 9: (15, 1, 19968)}  # const: (id, slices, MiB)

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"g{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"NVIDIA H100 80GB HBM3"  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h: object) -> object:
        if h == "g0":  # parent GPU of a MIG device in a container: not permitted
            raise self.NVMLError("Insufficient Permissions")
        if isinstance(h, tuple):
            return self._Obj(total=self.mig[h][2] * 2**20)
        return self._Obj(total=81559 * 2**20)

    def nvmlDeviceGetMigMode(self, h: str) -> list[int]:
        return [1, 1] if h == "g0" else [0, 0]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: str, const: int) -> object:
        pid, slices, mib = self.profiles[const]
        return self._Obj(id=pid, sliceCount=slices, memorySizeMB=mib)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: str, pid: int) -> int:
        return {19: 3, 9: 0, 15: 1}[pid]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: str) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: str, j: int) -> tuple[str, int]:
        if (h, j) not in self.mig:
            raise self.NVMLError_NotFound("Not Found")
        return (h, j)

    def nvmlDeviceGetAttributes(self, mh: tuple[str, int]) -> object:
        return self._Obj(gpuInstanceSliceCount=self.mig[mh][1])

    def nvmlDeviceGetGpuInstanceId(self, mh: tuple[str, int]) -> int:
        return self.mig[mh][3]

    def nvmlDeviceGetGpuInstanceById(self, h: str, gi: int) -> int:
        return gi

    def nvmlGpuInstanceGetInfo(self, gi: int) -> object:
        start = next(v[4] for v in self.mig.values() if v[3] == gi)
        return self._Obj(placement=self._Obj(start=start, size=0))

    def nvmlDeviceGetUUID(self, mh: tuple[str, int]) -> str:
        return self.mig[mh][0]


def test_read_nvml_maps_devices_slices_and_capacity() -> None:
    from placement.mig.inventory import read_nvml

    records = read_nvml(_FakeNvml())
    r0, r1 = records
    assert r0.gpu_type == "H100-80GB" and r0.mig_enabled and r0.total_mib is None  # parent not readable
    assert [(d.uuid, d.profile, d.start, d.memory_mib) for d in r0.mig_devices] == [
        ("MIG-x", "3g.40gb", 4, 40192),
        ("MIG-y", "1g.10gb", 0, 9984),
    ]
    assert r0.profile_memory_mib == {"1g.10gb": 9984, "3g.40gb": 40192, "1g.20gb": 19968}
    assert r0.remaining == {"1g.10gb": 3, "3g.40gb": 0, "1g.20gb": 1}
    assert not r1.mig_enabled and r1.total_mib == 81559 and r1.mig_devices == []
    fleet, _ = fleet_from_records(records, "gpu-host")
    [node] = fleet.nodes
    assert node.count == 2 and sorted(node.mig_layouts[0]) == ["1g.10gb", "3g.40gb"]
