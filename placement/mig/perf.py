"""What one replica of a model can serve on one device (a MIG slice or whole GPUs).

Decode is modelled as memory-bound with a compute floor: one step of a batch of ``b``
sequences reads the weights once and each sequence's KV (``avg_context_len`` tokens), so
``step = max((W + b x kv_read) / (BW x eff), b x 2 x active_params / (FLOPs x mfu)) + overhead``
and a replica delivers ``b / step`` tokens/s. A MIG slice gets ``memory_slices/8`` of the
bandwidth and ``compute_slices/7`` of the FLOP/s (decode speed scales with the slice's share
of bandwidth, SMs and L2). ``b`` is the largest batch the KV budget, ``max_num_seqs`` and the
ITL SLO allow. A replica that cannot hold its weights, one full-length sequence, or meet the
SLO at batch 1 has capacity 0 and a reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from placement.mig.catalog import GpuType
from placement.mig.config import ModelSpec, PerfModel
from placement.mig.memory import GiB, KvBudget, ModelArch, dtype_bytes, kv_budget


@dataclass(frozen=True)
class Device:
    """Memory and speed of what one rank of a replica runs on."""

    gpu: GpuType
    profile: str | None  # MIG profile, None for a whole GPU
    memory_mib: int
    bandwidth_gbs: float
    tflops: float

    @property
    def label(self) -> str:
        return f"{self.gpu.name} {self.profile or 'whole GPU'}"


def slice_device(gpu: GpuType, profile: str, memory_mib: int | None = None) -> Device:
    p = gpu.profile(profile)
    return Device(
        gpu,
        profile,
        memory_mib or p.memory_mib,
        gpu.bandwidth_gbs * p.size / 8,
        gpu.bf16_tflops * p.compute / 7,
    )


def whole_device(gpu: GpuType, memory_mib: int | None = None) -> Device:
    return Device(gpu, None, memory_mib or gpu.total_mib, gpu.bandwidth_gbs, gpu.bf16_tflops)


@dataclass(frozen=True)
class ReplicaPerf:
    device: Device
    tp: int
    budget: KvBudget
    batch: int  # concurrent sequences the replica runs
    step_ms: float  # decode step (inter-token latency) at that batch
    tokens_per_s: float  # 0 when infeasible
    reason: str  # why it cannot serve ("" when it can)


def replica_perf(spec: ModelSpec, arch: ModelArch, dev: Device, tp: int, perf: PerfModel) -> ReplicaPerf:
    d = spec.demand
    act = (
        int(spec.activation_gib * GiB)
        if spec.activation_gib is not None
        else arch.activation_bytes(spec.max_num_batched_tokens, spec.max_num_seqs, tp)
    )
    weight_dtype = spec.weight_dtype
    budget = kv_budget(
        arch,
        dev.memory_mib * 2**20,
        weight_dtype=weight_dtype,
        kv_dtype=spec.kv_dtype(),
        gpu_memory_utilization=spec.gpu_memory_utilization,
        block_size=spec.block_size,
        max_model_len=d.context_len,
        activation_bytes=act,
        tp=tp,
    )
    label = dev.label + (f" x{tp} (TP)" if tp > 1 else "")

    def fail(reason: str) -> ReplicaPerf:
        return ReplicaPerf(dev, tp, budget, 0, math.inf, 0.0, reason)

    if budget.available_kv_bytes <= 0:
        usable = dev.memory_mib * 2**20 * spec.gpu_memory_utilization
        return fail(
            f"weights {budget.weights_bytes / GiB:.1f} GiB + activations {act / GiB:.1f} GiB per rank exceed "
            f"{spec.gpu_memory_utilization:g} x {dev.memory_mib / 1024:.1f} GiB = {usable / GiB:.1f} GiB of {label}"
        )
    if not budget.fits:
        per_seq = arch.blocks_per_sequence(d.context_len, spec.block_size) * budget.page_size_bytes
        return fail(
            f"one {d.context_len}-token sequence needs {per_seq / GiB:.2f} GiB of KV, "
            f"{label} leaves {budget.available_kv_bytes / GiB:.2f} GiB"
        )
    kv_read = arch.blocks_per_sequence(d.avg_context_len or d.context_len // 2, 1) * arch.page_size_bytes(
        1, dtype_bytes(spec.kv_dtype()), tp
    )
    bw = dev.bandwidth_gbs * 1e9 * perf.bandwidth_efficiency
    flops = dev.tflops * 1e12 * perf.mfu
    per_tok_flops = 2 * arch.active_params() / tp

    def step_s(b: int) -> float:
        return max((budget.weights_bytes + b * kv_read) / bw, b * per_tok_flops / flops) + perf.step_overhead_ms / 1e3

    bmax = min(spec.max_num_seqs, budget.max_concurrent_seqs)
    b = bmax
    if d.itl_ms is not None:
        limit = d.itl_ms / 1e3
        if step_s(1) > limit:
            return fail(f"ITL SLO {d.itl_ms:g} ms unmet on {label}: {step_s(1) * 1e3:.1f} ms per token at batch 1")
        lo, hi = 1, bmax  # largest b with step_s(b) <= limit (step_s is increasing)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if step_s(mid) <= limit else (lo, mid - 1)
        b = lo
    tps = b / step_s(b) * perf.tp_efficiency ** math.log2(tp)
    return ReplicaPerf(dev, tp, budget, b, step_s(b) * 1e3, tps, "")
