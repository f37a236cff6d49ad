"""Seeded workload generators: agent episodes, GRPO bursts, Zipf system prompts, faults.

Token sequences are simulated as chains of block ids: a block id stands for the whole prefix up
to it, so blocks of a shared prefix (system prompt, GRPO prompt) have shared ids and every
later block is unique to its sequence (what chained hashing over real tokens gives).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.fleet_sim.engine import SimRequest

if TYPE_CHECKING:
    from bench.fleet_sim.sim import Fleet

_uids = itertools.count(1)


class Seq:
    """A growing token sequence whose first ``shared_tokens`` belong to the shared chain ``shared_uid``."""

    def __init__(self, block: int, shared_uid: int = 0, shared_tokens: int = 0) -> None:
        self.block = block
        self.uid = next(_uids)
        self.shared_uid = shared_uid
        self.shared_tokens = shared_tokens
        self.tokens = 0
        self.blocks: list[int] = []

    def append(self, n: int) -> None:
        self.tokens += n
        b = self.block
        while len(self.blocks) < self.tokens // b:
            i = len(self.blocks)
            owner = self.shared_uid if (i + 1) * b <= self.shared_tokens else self.uid
            self.blocks.append(owner * 1_000_003 + i)


def zipf_weights(k: int, alpha: float) -> list[float]:
    return [1.0 / (i + 1) ** alpha for i in range(k)]


@dataclass
class AgentWorkload:
    """Closed loop: ``concurrency`` episodes; each turn appends a tool output (think time) to the history."""

    concurrency: int = 256
    turns: tuple[int, int] = (5, 60)
    sys_prompts: int = 8
    sys_tokens: tuple[int, int] = (1000, 2000)
    zipf: float = 1.0
    user: tuple[int, int] = (100, 400)
    out: tuple[int, int] = (30, 300)
    tool: tuple[int, int] = (100, 1500)
    think_mean_s: float = 2.0
    max_tokens: int = 512
    name: str = "agentic"
    _sys: list[tuple[int, int]] = field(default_factory=list)

    def start(self, fleet: Fleet) -> None:
        rng = fleet.rng
        self._sys = [(next(_uids), rng.randint(*self.sys_tokens)) for _ in range(self.sys_prompts)]
        self._w = zipf_weights(self.sys_prompts, self.zipf)
        for _ in range(self.concurrency):
            fleet.at(rng.uniform(0, 2.0), self._new_episode)

    def _new_episode(self, fleet: Fleet) -> None:
        rng = fleet.rng
        uid, n = rng.choices(self._sys, self._w)[0]
        seq = Seq(fleet.block, uid, n)
        seq.append(n + rng.randint(*self.user))
        self._turn(fleet, f"ep{seq.uid}", seq, rng.randint(*self.turns), True)

    def _turn(self, fleet: Fleet, eid: str, seq: Seq, left: int, first: bool) -> None:
        prompt_blocks, prompt_tokens = list(seq.blocks), seq.tokens
        out = fleet.rng.randint(*self.out)
        seq.append(out)
        req = SimRequest(fleet.rid(), prompt_blocks, prompt_tokens, out, fleet.now, list(seq.blocks))
        req.owner = (self._done, eid, seq, left)
        fleet.submit(req, eid, "", first, self.max_tokens)

    def _done(self, fleet: Fleet, req: SimRequest) -> None:
        _, eid, seq, left = req.owner
        if left <= 1:
            fleet.release(eid, "")
            fleet.at(fleet.now + 0.1, self._new_episode)
            return
        seq.append(fleet.rng.randint(*self.tool))
        think = fleet.rng.expovariate(1 / self.think_mean_s)
        fleet.at(fleet.now + think, lambda f: self._turn(f, eid, seq, left - 1, False))


@dataclass
class GrpoWorkload:
    """Synchronous RL steps: ``groups`` prompts x ``G`` samples arrive as one burst; the next step follows."""

    G: int = 16
    groups: int = 16
    steps: int = 6
    prompt: tuple[int, int] = (500, 4000)
    out: tuple[int, int] = (100, 1000)
    trainer_s: float = 1.0
    max_tokens: int = 1024
    name: str = "grpo"
    group_prefill: list[float] = field(default_factory=list)  # prompt prefills per group (1.0 = once)
    group_prefill_full: list[float] = field(default_factory=list)  # same, not counting partial last blocks

    def start(self, fleet: Fleet) -> None:
        self._step = 0
        fleet.at(0.0, self._burst)

    def _burst(self, fleet: Fleet) -> None:
        rng = fleet.rng
        self._pending = self.groups * self.G
        self._acc: dict[str, list[int]] = {}
        for g in range(self.groups):
            gid = f"s{self._step}g{g}"
            plen = rng.randint(*self.prompt)
            puid = next(_uids)
            self._acc[gid] = [plen, 0, 0]
            for _ in range(self.G):
                seq = Seq(fleet.block, puid, plen)
                seq.append(plen)
                blocks = list(seq.blocks)
                out = rng.randint(*self.out)
                seq.append(out)
                req = SimRequest(fleet.rid(), blocks, plen, out, fleet.now, list(seq.blocks))
                req.owner = (self._done, gid)
                fleet.submit(req, f"ep{seq.uid}", gid, True, self.max_tokens)

    def _done(self, fleet: Fleet, req: SimRequest) -> None:
        gid = req.owner[1]
        acc = self._acc[gid]
        acc[1] += req.prompt_tokens - req.cached
        # Engines cache full blocks only: each member recomputes the prompt's partial last block.
        acc[2] += max(0, req.prompt_tokens - req.cached - req.prompt_tokens % fleet.block)
        self._pending -= 1
        if self._pending == 0:
            self.group_prefill += [a[1] / a[0] for a in self._acc.values()]
            self.group_prefill_full += [a[2] / a[0] for a in self._acc.values()]
            for gid in self._acc:
                fleet.release("", gid)
            self._step += 1
            if self._step < self.steps:
                fleet.at(fleet.now + self.trainer_s, self._burst)
            else:
                fleet.stop_at(fleet.now)


@dataclass
class SysPromptWorkload:
    """Open loop Poisson arrivals; each request = one of ``k`` shared prefixes (Zipf) + a unique suffix."""

    rate: float = 40.0
    k: int = 256
    zipf: float = 1.2
    prefix: tuple[int, int] = (2000, 8000)
    suffix: tuple[int, int] = (200, 1200)
    out: tuple[int, int] = (50, 300)
    max_tokens: int = 512
    oneoff_every: int = 0  # every n-th request is a one-off long document (no shared prefix)
    oneoff_tokens: tuple[int, int] = (8000, 16000)
    scan_period_s: float = 0.0  # > 0: every period, a scan of one-off documents (a batch job) ...
    scan_s: float = 2.0  # ... lasting this long ...
    scan_rate: float = 40.0  # ... at this many requests per second, on top of the shared-prefix traffic
    name: str = "sysprompt"
    shared_prompt: int = 0
    shared_recomputed: int = 0

    def start(self, fleet: Fleet) -> None:
        rng = fleet.rng
        self._pre = [(next(_uids), rng.randint(*self.prefix)) for _ in range(self.k)]
        self._w = zipf_weights(self.k, self.zipf)
        self._n = 0
        fleet.at(rng.expovariate(self.rate), self._arrive)
        if self.scan_period_s > 0:
            fleet.at(self.scan_period_s, self._scan)

    def _oneoff_done(self, fleet: Fleet, req: SimRequest) -> None:
        return None

    def _shared_done(self, fleet: Fleet, req: SimRequest) -> None:
        if req.arrival >= fleet.warmup:  # recompute of requests that share a prefix (avoidable)
            self.shared_prompt += req.prompt_tokens
            self.shared_recomputed += req.prompt_tokens - req.cached

    def _scan(self, fleet: Fleet) -> None:
        t = fleet.now
        while t < fleet.now + self.scan_s:
            t += fleet.rng.expovariate(self.scan_rate)
            fleet.at(t, self._arrive, True)
        fleet.at(fleet.now + self.scan_period_s, self._scan)

    def _arrive(self, fleet: Fleet, scan: bool = False) -> None:
        rng = fleet.rng
        self._n += 1
        if scan or (self.oneoff_every and self._n % self.oneoff_every == 0):
            seq = Seq(fleet.block)
            seq.append(rng.randint(*self.oneoff_tokens))
        else:
            uid, n = rng.choices(self._pre, self._w)[0]
            seq = Seq(fleet.block, uid, n)
            seq.append(n + rng.randint(*self.suffix))
        blocks, ptoks = list(seq.blocks), seq.tokens
        out = rng.randint(*self.out)
        seq.append(out)
        req = SimRequest(fleet.rid(), blocks, ptoks, out, fleet.now, list(seq.blocks))
        req.owner = (self._oneoff_done if seq.shared_uid == 0 else self._shared_done,)
        fleet.submit(req, f"ep{seq.uid}", "", True, self.max_tokens)
        if not scan:
            fleet.at(fleet.now + rng.expovariate(self.rate), self._arrive)


@dataclass
class Faults:
    """Replica restart and scale-out events on top of another workload."""

    restart_at: float = -1.0
    restart_replica: int = 0
    scale_out_at: float = -1.0
    scale_out_to: int = 0

    def install(self, fleet: Fleet) -> None:
        if self.restart_at >= 0:
            fleet.at(self.restart_at, lambda f: f.restart(self.restart_replica))
        if self.scale_out_at >= 0:
            fleet.at(self.scale_out_at, lambda f: f.scale_out(self.scale_out_to))


Callback = Callable[["Fleet"], None]
