"""MIG catalog: every valid H100 geometry is enumerated, invalid ones are rejected (acceptance 2)."""

from __future__ import annotations

import itertools

import pytest

from placement.mig.catalog import (
    GPU_TYPES,
    all_geometries,
    gpu_type,
    is_valid_geometry,
    layout_of,
    maximal_layouts,
    place_layout,
)

H100 = GPU_TYPES["H100-80GB"]


def _independent_valid(placements: tuple[tuple[str, int], ...]) -> bool:
    """A second, deliberately naive statement of the rule: slices as sets, the lgipp table inline."""
    table = {  # profile: (compute slices, memory slices, starts) from `nvidia-smi mig -lgipp` on H100
        "1g.10gb": (1, 1, range(7)),
        "1g.20gb": (1, 2, (0, 2, 4, 6)),
        "2g.20gb": (2, 2, (0, 2, 4)),
        "3g.40gb": (3, 4, (0, 4)),
        "4g.40gb": (4, 4, (0,)),
        "7g.80gb": (7, 8, (0,)),
    }
    used: set[int] = set()
    compute = 0
    for name, start in placements:
        c, size, starts = table[name]
        if start not in starts:
            return False
        cells = set(range(start, start + size))
        if used & cells:
            return False
        used |= cells
        compute += c
    return compute <= 7


def test_every_valid_h100_geometry_is_enumerated_and_nothing_else() -> None:
    candidates = [(p.name, s) for p in H100.placeable for s in p.starts]
    assert len(candidates) == 7 + 4 + 3 + 2 + 1 + 1
    brute = {
        tuple(sorted(c))
        for r in range(1, 8)
        for c in itertools.combinations(candidates, r)
        if _independent_valid(tuple(c))
    }
    enumerated = set(all_geometries(H100))
    assert enumerated == brute
    assert len(enumerated) == 722
    assert len({layout_of(g) for g in enumerated}) == 77  # distinct profile multisets
    assert len(maximal_layouts("H100-80GB")) == 38


def test_a100_without_double_memory_profile_has_nvidias_19_configurations() -> None:
    """The MIG User Guide's A100 table lists 19 valid configurations (before 1g.10gb existed)."""
    gpu = GPU_TYPES["A100-40GB"]
    allowed = [p for p in gpu.placeable if p.name != "1g.10gb"]
    geos = [g for g in all_geometries(gpu) if all(n != "1g.10gb" for n, _ in g)]
    maximal = [
        g for g in geos if not any(is_valid_geometry(gpu, (*g, (p.name, s)))[0] for p in allowed for s in p.starts)
    ]
    assert len(maximal) == 19


@pytest.mark.parametrize(
    "layout",
    [
        ["7g.80gb"],
        ["1g.10gb"] * 7,
        ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"],  # mig-parted "balanced"
        ["4g.40gb", "3g.40gb"],
        ["3g.40gb", "3g.40gb"],
        ["1g.20gb"] * 4,
        ["3g.40gb"] + ["1g.10gb"] * 4,  # only with the 3g at memory slice 4: creation order matters
        ["2g.20gb"] * 3 + ["1g.10gb"],
    ],
)
def test_known_valid_layouts_are_placed(layout: list[str]) -> None:
    geo = place_layout(H100, layout)
    assert geo is not None
    assert sorted(layout) == list(layout_of(geo))
    assert is_valid_geometry(H100, geo) == (True, "")


@pytest.mark.parametrize(
    ("placements", "why"),
    [
        ([("4g.40gb", 0), ("4g.40gb", 0)], "overlaps"),
        ([("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 6)], "overlaps"),
        ([("7g.80gb", 0), ("1g.10gb", 0)], "overlaps"),
        ([("1g.10gb", 7)], "cannot start"),
        ([("2g.20gb", 1)], "cannot start"),
        ([("3g.40gb", 2)], "cannot start"),
        ([("4g.40gb", 4)], "cannot start"),
        ([("5g.50gb", 0)], "does not exist"),
        ([("1g.10gb+me", 0), ("1g.10gb+me", 1)], "at most 1"),
    ],
)
def test_invalid_geometries_are_rejected_with_a_reason(placements: list[tuple[str, int]], why: str) -> None:
    ok, reason = is_valid_geometry(H100, placements)
    assert not ok
    assert why in reason


@pytest.mark.parametrize("layout", [["4g.40gb", "4g.40gb"], ["3g.40gb"] * 3, ["1g.10gb"] * 8, ["7g.80gb", "1g.10gb"]])
def test_impossible_layouts_have_no_placement(layout: list[str]) -> None:
    assert place_layout(H100, layout) is None


def test_families_carry_the_reference_profile_names() -> None:
    expect = {
        "A100-40GB": ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        "A100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "H100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "H100-NVL": ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
        "H200": ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
        "B200": ["1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    }
    for name, profiles in expect.items():
        gpu = GPU_TYPES[name]
        assert [p.name for p in gpu.placeable] == profiles
        assert [p.max_count for p in gpu.placeable] == [7, 4, 3, 2, 1, 1]
        assert len(maximal_layouts(name)) == 38
    assert GPU_TYPES["H200"].profile("1g.35gb").memory_mib == 33280  # 32.5 GiB, not the nominal 35 GB


@pytest.mark.parametrize(
    ("nvml_name", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_nvml_device_names_map_to_catalog_types(nvml_name: str, key: str) -> None:
    assert gpu_type(nvml_name).name == key


def test_unknown_device_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        gpu_type("NVIDIA GeForce RTX 4090")
