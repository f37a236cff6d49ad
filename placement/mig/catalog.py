"""MIG profiles, their valid placements, and the GPU types the placer knows, as data.

Sources (see ``docs/placement.md``): the profile tables are NVIDIA's MIG User Guide pages
"Supported MIG Profiles" / "Supported GPUs" and the GPU-operator defaults in
``NVIDIA/mig-parted:deployments/systemd/config-default.yaml``; placements are what
``nvidia-smi mig -lgipp`` prints on A100-80GB/H100 (``{start positions}:size`` in memory
slices). Every family listed here has the same geometry (8 memory slices, 7 compute slices,
the same start positions), so one template describes all of them.

Invariants:

* A *placement* is ``(profile, start)``; it occupies memory slices ``start .. start+size-1``
  and ``profile.compute`` compute slices. A *geometry* is a set of placements whose memory
  slices do not overlap, whose compute slices add up to at most 7 and which use each profile
  at most ``max_count`` times. ``is_valid_geometry`` is the one check; everything the placer
  emits passes it.
* Profile names are nominal (``1g.35gb`` exposes 32.5 GiB on an H200). ``memory_mib`` here is
  a conservative estimate: the nominal size read as decimal GB, or a measured value where one
  is published. The NVML inventory and the fleet file's ``profile_memory_mib`` replace it with
  the real ``memorySizeMB``.
* Bandwidth and bf16 dense TFLOP/s are datasheet figures of the SXM/HGX parts; they feed the
  throughput model only, never validity.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfile:
    name: str  # e.g. "1g.10gb"
    compute: int  # compute slices (the "Ng" of the name)
    size: int  # memory slices occupied
    starts: tuple[int, ...]  # valid memory-slice start positions
    max_count: int  # instances per GPU
    memory_mib: int  # usable memory estimate (see module docstring)
    media: bool = False  # the "+me" variant (media engines); never chosen by the placer

    @property
    def mask_at(self) -> dict[int, int]:
        return {s: ((1 << self.size) - 1) << s for s in self.starts}


@dataclass(frozen=True)
class GpuType:
    name: str  # catalog key, e.g. "H100-80GB"
    total_mib: int  # whole-GPU memory as NVML typically reports it (MIG disabled)
    bandwidth_gbs: float  # HBM bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor TFLOP/s
    profiles: tuple[MigProfile, ...]
    nvml_names: tuple[str, ...]  # substrings of nvmlDeviceGetName that identify this type

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def placeable(self) -> tuple[MigProfile, ...]:
        """Profiles the placer may choose (the media variant is left to operators)."""
        return tuple(p for p in self.profiles if not p.media)


def _gb_to_mib(gb: float) -> int:
    return int(gb * 1e9 / 2**20)


def _family(one: int, double: int, two: int, three: int, seven: int, known: dict[str, int]) -> tuple[MigProfile, ...]:
    """The shared placement template, with one family's nominal sizes (GB)."""
    spec = [
        # name, compute, memory slices, starts, max instances, nominal GB
        (f"1g.{one}gb", 1, 1, tuple(range(7)), 7, one),
        (f"1g.{double}gb", 1, 2, (0, 2, 4, 6), 4, double),
        (f"2g.{two}gb", 2, 2, (0, 2, 4), 3, two),
        (f"3g.{three}gb", 3, 4, (0, 4), 2, three),
        (f"4g.{three}gb", 4, 4, (0,), 1, three),
        (f"7g.{seven}gb", 7, 8, (0,), 1, seven),
    ]
    out = [MigProfile(n, c, s, st, m, known.get(n, _gb_to_mib(gb))) for n, c, s, st, m, gb in spec]
    one_p = out[0]
    out.append(MigProfile(f"1g.{one}gb+me", 1, 1, one_p.starts, 1, one_p.memory_mib, media=True))
    return tuple(out)


# Measured sizes that differ from the nominal estimate: A100-80GB 1g.10gb is 9728 MiB in
# nvidia-smi; H200 1g.35gb exposes 32.5 GiB (vLLM PR #50463).
_KNOWN_A100_80 = {"1g.10gb": 9728}
_KNOWN_H200 = {"1g.35gb": 33280}

GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100-40GB", 40960, 1555, 312, _family(5, 10, 10, 20, 40, {}), ("A100-SXM4-40GB", "A100-PCIE-40GB")),
        GpuType("A100-80GB", 81920, 2039, 312, _family(10, 20, 20, 40, 80, _KNOWN_A100_80), ("A100", "A800")),
        GpuType("H100-80GB", 81559, 3350, 989, _family(10, 20, 20, 40, 80, {}), ("H100 80GB", "H100 PCIe", "H800")),
        GpuType("H100-NVL", 95830, 3900, 835, _family(12, 24, 24, 47, 94, {}), ("H100 NVL",)),
        GpuType("H200", 143771, 4800, 989, _family(18, 35, 35, 71, 141, _KNOWN_H200), ("H200",)),
        GpuType("B200", 183359, 8000, 2250, _family(23, 45, 45, 90, 180, {}), ("B200",)),
    )
}

SOURCE_NOTE = (
    "MIG profiles: NVIDIA MIG User Guide (Supported MIG Profiles) and NVIDIA/mig-parted "
    "config-default.yaml; placements: `nvidia-smi mig -lgipp` on A100-80GB/H100, same template on all families."
)


def gpu_type(name: str) -> GpuType:
    """Catalog entry by key (``H100-80GB``) or by an NVML device name (``NVIDIA H100 80GB HBM3``)."""
    if name in GPU_TYPES:
        return GPU_TYPES[name]
    upper = name.upper()
    # Longest alias first so "H100 NVL" wins over a shorter match and "A100-SXM4-40GB" over "A100".
    matches = [(len(a), g) for g in GPU_TYPES.values() for a in g.nvml_names if a.upper() in upper]
    if not matches:
        raise KeyError(name)
    return max(matches, key=lambda t: t[0])[1]


Placement = tuple[str, int]  # (profile name, memory-slice start)


def is_valid_geometry(gpu: GpuType, placements: Iterable[Placement]) -> tuple[bool, str]:
    """Whether ``placements`` can coexist on one GPU of type ``gpu``; (False, why) if not."""
    used_mask = 0
    compute = 0
    counts: Counter[str] = Counter()
    for name, start in placements:
        try:
            p = gpu.profile(name)
        except KeyError:
            return False, f"profile {name!r} does not exist on {gpu.name}"
        if start not in p.starts:
            return False, f"{name} cannot start at memory slice {start} (valid starts: {list(p.starts)})"
        mask = p.mask_at[start]
        if used_mask & mask:
            return False, f"{name}@{start} overlaps memory slices already in use"
        used_mask |= mask
        compute += p.compute
        counts[name] += 1
        if counts[name] > p.max_count:
            return False, f"at most {p.max_count} x {name} per GPU"
    if compute > COMPUTE_SLICES:
        return False, f"{compute} compute slices used, a GPU has {COMPUTE_SLICES}"
    return True, ""


def _geometries(gpu: GpuType, profiles: tuple[MigProfile, ...]) -> Iterator[tuple[tuple[Placement, ...], bool]]:
    """Every valid non-empty geometry (placements in canonical, increasing order) and whether it is
    maximal (no placeable profile fits beside it). The ``is_valid_geometry`` rules on bit masks."""
    cands = [(p, (p.name, s), m) for p in profiles for s, m in p.mask_at.items()]
    cands.sort(key=lambda c: c[1])
    extra = [(p, m) for p in gpu.placeable for m in p.mask_at.values()]
    stack: list[tuple[tuple[Placement, ...], int, int, dict[str, int], int]] = [((), 0, 0, {}, 0)]
    while stack:
        cur, used, compute, counts, first = stack.pop()
        for i in range(first, len(cands)):
            p, cand, m = cands[i]
            if used & m or compute + p.compute > COMPUTE_SLICES or counts.get(p.name, 0) >= p.max_count:
                continue
            nxt = (*cur, cand)
            n_used, n_compute, n_counts = used | m, compute + p.compute, {**counts, p.name: counts.get(p.name, 0) + 1}
            full = not any(
                not n_used & m2 and n_compute + p2.compute <= COMPUTE_SLICES and n_counts.get(p2.name, 0) < p2.max_count
                for p2, m2 in extra
            )
            yield nxt, full
            stack.append((nxt, n_used, n_compute, n_counts, i + 1))


def all_geometries(gpu: GpuType, include_media: bool = False) -> list[tuple[Placement, ...]]:
    """Every valid non-empty set of placements (sorted tuples) on one GPU of this type."""
    return sorted(geo for geo, _ in _geometries(gpu, gpu.profiles if include_media else gpu.placeable))


def layout_of(placements: Iterable[Placement]) -> tuple[str, ...]:
    """The profile multiset of a geometry (what a mig-parted config names), sorted."""
    return tuple(sorted(n for n, _ in placements))


@functools.cache
def maximal_layouts(gpu_name: str) -> tuple[tuple[tuple[str, ...], tuple[Placement, ...]], ...]:
    """Layouts to which no placeable profile can be added, each with one geometry realising it.

    Any valid geometry is contained in one of these, so a placer that chooses among them (and
    may leave slices idle) loses nothing.
    """
    gpu = GPU_TYPES[gpu_name]
    best: dict[tuple[str, ...], tuple[Placement, ...]] = {}
    for geo in sorted(geo for geo, full in _geometries(gpu, gpu.placeable) if full):
        best.setdefault(layout_of(geo), geo)
    return tuple(sorted(best.items()))


def place_layout(gpu: GpuType, layout: Iterable[str]) -> tuple[Placement, ...] | None:
    """A geometry realising a profile multiset, or None when no placement order fits it."""
    names = sorted(layout, key=lambda n: (-gpu.profile(n).size, n))  # largest first: creation order matters

    def go(i: int, acc: tuple[Placement, ...]) -> tuple[Placement, ...] | None:
        if i == len(names):
            return acc
        p = gpu.profile(names[i])
        # Instances of one profile are interchangeable: place them at increasing starts only.
        floor = acc[-1][1] if acc and acc[-1][0] == p.name else -1
        for s in (s for s in p.starts if s > floor):
            nxt = (*acc, (p.name, s))
            if is_valid_geometry(gpu, nxt)[0]:
                done = go(i + 1, nxt)
                if done is not None:
                    return done
        return None

    try:
        return go(0, ())
    except KeyError:
        return None
