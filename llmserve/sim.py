"""Discrete-time, deterministic serving simulator: one ``step`` = one window of the task.

Inside a window the engine runs iterations (continuous batching, as in Orca/vLLM):

1. arrivals up to the current time join the waiting queue (FIFO, or by priority class then arrival
   when ``priority_routing``); a request is admitted while fewer than ``batch_cap`` run and its
   prompt (+ already generated tokens, after a preemption) fits in the free KV;
2. colocated: one iteration prefills the newly admitted prompts and decodes every running
   sequence, ``prefill_ms(new) + decode_ms(ctx, batch)`` (the interference DistServe removes);
   split: prompts prefill on a second GPU's own timeline and join decoding after a KV transfer
   (``kv_bytes / kv_transfer_gb_s``), and the GPU bill doubles;
3. speculation depth ``k`` with acceptance ``alpha`` yields ``(1 - alpha^(k+1)) / (1 - alpha)``
   tokens per sequence per target step; the target verifies ``k+1`` tokens per sequence (the
   per-sequence decode term scales by ``k+1``) and the draft costs ``k x 10%`` of a decode step;
4. when the KV cache overflows, the newest lowest-priority sequence is preempted (recompute:
   it re-queues with its generated tokens and re-prefills them) and counted as an eviction.

KV capacity comes from ``placement.mig.memory.kv_budget`` for the task's GPU, the model config and
the quantization tier's weight dtype, times ``kv_budget_fraction``. Nothing here draws random
numbers: the workload is fixed at reset, so the same seed and actions give bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from llmserve.models import ServeAction
from llmserve.profiles import DISTSERVE_A100_OPT13B, OPT_13B_CONFIG, TIERS, CostCoefficients, QuantTier
from llmserve.tasks import Request, TaskSpec
from placement.mig.memory import GiB, ModelArch, kv_budget

DRAFT_COST = 0.10  # one draft token costs 10% of a target decode step (a ~10x smaller draft model)
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Capacity:
    weights_bytes: int
    activation_bytes: int
    kv_tokens: int  # at kv_budget_fraction 1.0
    kv_bytes_per_token: int


@lru_cache(maxsize=32)
def capacity(memory_gib: float, tier: QuantTier) -> Capacity:
    arch = ModelArch.from_config(dict(OPT_13B_CONFIG))
    act = arch.activation_bytes(8192, 256)
    budget = kv_budget(
        arch,
        int(memory_gib * GiB),
        weight_dtype=TIERS[tier].weight_dtype,
        kv_dtype="fp16",
        gpu_memory_utilization=0.95,
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        activation_bytes=act,
    )
    return Capacity(budget.weights_bytes, act, max(0, budget.kv_tokens), arch.kv_bytes_per_token(2))


class _Seq:
    """A request in flight; ``done_tokens`` may be fractional (expected speculative tokens)."""

    __slots__ = ("admitted_s", "done_tokens", "first_token_s", "ready_s", "req")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.done_tokens = 0.0
        self.first_token_s: float | None = None
        self.ready_s = 0.0
        self.admitted_s = 0.0

    def kv(self) -> int:
        return self.req.prompt_len + int(self.done_tokens)


@dataclass
class WindowStats:
    ttfts_ms: list[float] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)
    tokens: float = 0.0
    good_tokens: float = 0.0
    judged: int = 0
    met: int = 0
    evictions: int = 0
    arrivals: int = 0
    prompt_tokens: int = 0
    gpu_seconds: float = 0.0
    elapsed_s: float = 0.0  # the window's length when it is measured (real mode); 0 = the task's window_s


class Simulator:
    """One episode's engine state."""

    def __init__(self, spec: TaskSpec, workload: list[list[Request]], coeffs: CostCoefficients | None = None) -> None:
        self.spec = spec
        self.workload = workload
        self.coeffs = coeffs or DISTSERVE_A100_OPT13B
        self.now = 0.0
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.prefill_free_s = 0.0
        self.window = 0

    # -- the window loop -------------------------------------------------------------------------

    def run_window(self, action: ServeAction) -> WindowStats:
        spec = self.spec
        end = (self.window + 1) * spec.window_s
        arrivals = list(self.workload[self.window])
        st = WindowStats(arrivals=len(arrivals), prompt_tokens=sum(r.prompt_len for r in arrivals))
        cap = self.kv_capacity(action)
        while self.now < end:
            while arrivals and arrivals[0].arrival_s <= self.now:
                self.waiting.append(_Seq(arrivals.pop(0)))
            new = self._admit(action, cap, st)
            if not new and not self._decodable():
                nxt = min([a.arrival_s for a in arrivals[:1]] + [s.ready_s for s in self.running] + [end])
                self.now = max(nxt, self.now + 1e-6) if nxt > self.now else end
                continue
            self._iterate(action, new, st)
            self._evict(action, cap, st)
        self.waiting.extend(_Seq(r) for r in arrivals)  # only if the window ended exactly on them
        self._judge_overdue(st)
        st.gpu_seconds = spec.window_s * (2 if action.prefill_decode_split else 1)
        self.window += 1
        return st

    def kv_capacity(self, action: ServeAction) -> int:
        c = capacity(self.spec.hardware.memory_gib, action.quantization_tier)
        return int(c.kv_tokens * action.kv_budget_fraction)

    def kv_used(self) -> int:
        return sum(s.kv() for s in self.running)

    def _decodable(self) -> bool:
        return any(s.ready_s <= self.now for s in self.running)

    def _admit(self, action: ServeAction, cap: int, st: WindowStats) -> list[_Seq]:
        if action.priority_routing:
            self.waiting.sort(key=lambda s: (s.req.priority, s.req.arrival_s, s.req.rid))
        new: list[_Seq] = []
        used = self.kv_used()
        keep: list[_Seq] = []
        for s in self.waiting:
            if s.kv() > cap:  # can never fit under this budget: dropped, an SLO violation
                st.judged += 1
                continue
            if len(self.running) + len(new) < action.batch_cap and used + s.kv() <= cap:
                used += s.kv()
                s.admitted_s = self.now
                new.append(s)
            else:
                keep.append(s)
        self.waiting = keep
        return new

    def _iterate(self, action: ServeAction, new: list[_Seq], st: WindowStats) -> None:
        tier = TIERS[action.quantization_tier]
        k = action.speculation_depth
        lens = [s.kv() for s in new]
        prefill = self.coeffs.prefill_ms(lens) * tier.prefill_scale / 1000
        if action.prefill_decode_split and new:
            start = max(self.prefill_free_s, self.now)
            self.prefill_free_s = start + prefill
            cap = capacity(self.spec.hardware.memory_gib, action.quantization_tier)
            for s in new:
                s.ready_s = self.prefill_free_s + s.kv() * cap.kv_bytes_per_token / (
                    self.spec.hardware.kv_transfer_gb_s * 1e9
                )
            prefill = 0.0
        else:
            for s in new:
                s.ready_s = self.now
        self.running.extend(new)
        batch = [s for s in self.running if s.ready_s <= self.now]
        ctx = sum(s.kv() for s in batch)
        step = self.coeffs.decode_ms(ctx, len(batch) * (k + 1)) * tier.decode_scale
        step += k * DRAFT_COST * self.coeffs.decode_ms(ctx, len(batch)) * tier.decode_scale
        self.now += prefill + step / 1000
        tokens = self.expected_tokens(k)
        for s in batch:
            if s.first_token_s is None:
                s.first_token_s = self.now
                st.ttfts_ms.append((self.now - s.req.arrival_s) * 1000)
            s.done_tokens = min(float(s.req.output_len), s.done_tokens + tokens)
        st.tokens += len(batch) * tokens
        self._finish(batch, st)

    def expected_tokens(self, k: int) -> float:
        a = self.spec.spec_alpha
        return (1 - a ** (k + 1)) / (1 - a) if k else 1.0

    def _finish(self, batch: list[_Seq], st: WindowStats) -> None:
        spec = self.spec
        for s in batch:
            if s.done_tokens < s.req.output_len:
                continue
            assert s.first_token_s is not None
            ttft = (s.first_token_s - s.req.arrival_s) * 1000
            itl = (self.now - s.first_token_s) * 1000 / max(1, s.req.output_len - 1)
            st.itls_ms.append(itl)
            st.judged += 1
            if ttft <= spec.ttft_slo_ms[s.req.priority] and itl <= spec.itl_slo_ms:
                st.met += 1
                st.good_tokens += s.req.output_len
            self.running.remove(s)

    def _evict(self, action: ServeAction, cap: int, st: WindowStats) -> None:
        while self.running and self.kv_used() > cap:
            if action.priority_routing:
                victim = max(self.running, key=lambda s: (s.req.priority, s.admitted_s, s.req.rid))
            else:
                victim = max(self.running, key=lambda s: (s.admitted_s, s.req.rid))
            self.running.remove(victim)
            victim.ready_s = 0.0
            self.waiting.insert(0, victim)
            st.evictions += 1

    def _judge_overdue(self, st: WindowStats) -> None:
        """Waiting requests already past their TTFT SLO count as violations of this window."""
        for s in self.waiting:
            if s.first_token_s is None and (self.now - s.req.arrival_s) * 1000 > self.spec.ttft_slo_ms[s.req.priority]:
                st.judged += 1
