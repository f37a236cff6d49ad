"""Simulated engine replica: an engine-true LRU KV cache of blocks and a continuous-batching step model.

Step model (one engine iteration): every running sequence decodes one token, and waiting
requests are admitted (FIFO, up to ``max_seqs``) and prefilled in chunks inside a token budget
of ``max_batch_tokens``. Step time = ``step_s + prefill_tokens x prefill_s + decodes x decode_s``.
A request's cached prefix is decided at admission (the longest chain of its prompt blocks the
KV cache still holds, capped at prompt - 1 token like vLLM); its prompt blocks enter the cache
when its prefill completes, its output blocks when it finishes. Eviction is LRU over blocks
with a chain's tail older than its parents (engines free tails first). Pure decode stretches
are fast-forwarded to the next event, which keeps long simulations cheap. A waiting request
whose prompt prefix another request on the replica is prefilling right now waits a step and
then hits the cache (SGLang's in-batch prefix check; what lets a GRPO group prefill once).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineSpec:
    kv_tokens: int = 400_000  # KV cache capacity of one replica, in tokens
    block: int = 64
    max_seqs: int = 64
    max_batch_tokens: int = 8192
    step_s: float = 0.004
    prefill_s: float = 1 / 20_000  # per prefill token
    decode_s: float = 0.00012  # per sequence in the batch
    dedup_inflight: bool = True  # defer a request whose prefix another one is prefilling (SGLang in-batch check)


class KVCache:
    """Engine-true LRU of block ids (each id stands for the whole prefix up to that block)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: list[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.lru:
                break
            n += 1
        return n

    def touch(self, blocks: list[int]) -> None:
        lru = self.lru
        for h in reversed(blocks):  # parents end up most recent: tails are evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        self.lru.clear()


@dataclass(slots=True)
class SimRequest:
    rid: int
    blocks: list[int]  # prompt blocks (full blocks only)
    prompt_tokens: int
    out_tokens: int
    arrival: float
    held_after: list[int]  # blocks of prompt + output (what the engine holds when done)
    owner: Any = None  # workload bookkeeping (episode, group, ...)
    route: Any = None  # the bridge's decision and load
    cached: int = 0
    remaining: int = 0
    generated: int = 0
    first_token: float = -1.0
    done: float = -1.0


@dataclass(slots=True)
class Replica:
    idx: int
    spec: EngineSpec
    kv: KVCache = field(init=False)
    waiting: deque[SimRequest] = field(default_factory=deque)
    prefilling: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    busy: bool = False
    up: bool = True
    work_tokens: int = 0  # prefill + decode tokens processed
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.kv = KVCache(self.spec.kv_tokens // self.spec.block)

    def inflight_tokens(self) -> int:
        return (
            sum(r.prompt_tokens - r.cached + r.out_tokens for r in self.waiting)
            + sum(r.remaining + r.out_tokens for r in self.prefilling)
            + sum(r.out_tokens - r.generated for r in self.running)
        )

    def _covered_inflight(self, blocks: list[int]) -> int:
        """Longest prefix of ``blocks`` a request being prefilled here is computing."""
        best = 0
        if not blocks:
            return 0
        for p in self.prefilling:
            if p.blocks and p.blocks[0] == blocks[0]:
                n = 0
                for a, b in zip(p.blocks, blocks, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
        return best

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def step(self, now: float, next_event: float) -> tuple[float, list[SimRequest], list[SimRequest]]:
        """Run one iteration (or a fast-forwarded decode stretch); returns (duration, first tokens, finished)."""
        spec = self.spec
        budget = spec.max_batch_tokens - len(self.running)
        deferred: list[SimRequest] = []
        while self.waiting and len(self.running) + len(self.prefilling) < spec.max_seqs and budget > 0:
            r = self.waiting.popleft()
            hit = self.kv.match(r.blocks)
            if spec.dedup_inflight and self._covered_inflight(r.blocks) > hit + 4:
                deferred.append(r)  # its prefix is being computed right now: reuse it next step
                continue
            if hit:
                self.kv.touch(r.blocks[:hit])
            r.cached = min(hit * spec.block, r.prompt_tokens - 1)
            r.remaining = r.prompt_tokens - r.cached
            self.prefilling.append(r)
            budget -= min(r.remaining, budget)
        self.waiting.extendleft(reversed(deferred))
        prefill = 0
        budget = spec.max_batch_tokens - len(self.running)
        for r in self.prefilling:
            take = min(r.remaining, budget)
            r.remaining -= take
            prefill += take
            budget -= take
            if budget <= 0:
                break
        decodes = len(self.running)
        dur = spec.step_s + prefill * spec.prefill_s + decodes * spec.decode_s
        k = 1
        if prefill == 0 and decodes and (not self.waiting or decodes >= spec.max_seqs):
            left = min(r.out_tokens - r.generated for r in self.running)
            k = max(1, min(left, int((next_event - now) / dur)))
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        end = now + dur * k
        for r in self.running:
            r.generated += k
        self.work_tokens += prefill + decodes * k
        self.busy_s += dur * k
        still = []
        for r in self.prefilling:
            if r.remaining == 0:
                r.first_token = end
                r.generated = 1
                self.kv.touch(r.blocks)
                first.append(r)
                self.running.append(r)
            else:
                still.append(r)
        self.prefilling = still
        keep = []
        for r in self.running:
            if r.generated >= r.out_tokens:
                r.done = end
                self.kv.touch(r.held_after)
                finished.append(r)
            else:
                keep.append(r)
        self.running = keep
        return dur * k, first, finished

    def restart(self) -> list[SimRequest]:
        """Crash + restart: the KV cache is gone; queued and running work is returned for re-routing."""
        lost = [*self.waiting, *self.prefilling, *self.running]
        self.waiting.clear()
        self.prefilling = []
        self.running = []
        self.kv.clear()
        return lost
