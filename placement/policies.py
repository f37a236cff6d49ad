"""Routing policies: which engine replica serves a turn, behind one small ``Policy`` protocol.

The bridge calls, per turn: ``choose(RouteRequest)`` -> ``Decision``; ``on_begin`` /
``on_end`` around the engine call (load = in-flight tokens per replica, prefill + decode;
``load`` is this bridge's own, ``remote`` the other bridges' as a load board last reported
them, cache/loadboard.py); ``on_engine_report`` with the engine's cached-token count once the
turn ends (confirms or drops the index entries written at routing time); ``release`` when an
episode or GRPO group ends.

Policies:

- ``round_robin``, ``least_loaded``: cache-blind baselines.
- ``sticky``: an episode (and every member of a GRPO group) stays where its first turn went;
  first turns go to the least-loaded replica. Pins are local to one bridge.
- ``consistent_hash``: a hash ring (virtual nodes) over the group id, else the episode id
  (``ring_key="prefix"``: the first block's hash, SGLang's ``prefix_hash``);
  ``ring_load_bound`` > 0 gives bounded-load hashing (skip replicas above bound x mean).
- ``cache_aware`` (default): a GRPO group is pinned to one replica (shared through the index,
  so every bridge agrees); a continuing episode stays on its pinned replica unless that
  replica is *hot*; otherwise the replica minimising
  ``load_r + prefill_weight x (prompt_tokens - cached_prefix_r)`` wins, among replicas that
  are not hot. Hot = ``load_r - min_load > balance_abs_tokens`` and
  ``load_r > balance_rel x (min_load + 1)`` (SGLang's imbalance test, per replica), so a hot
  replica sheds new episodes but keeps the turns whose KV it holds while it is not hot.
  When the index fails open (Redis down or slow) the same formula runs with no cached
  prefixes: load-only routing, plus this bridge's own episode pins.

Replica health (``mark``): an unhealthy replica gets no turns while a healthy one exists (a
pin to it is ignored, so the episode moves; the bridge resubmits its history there).

Invariants: ``choose`` never raises for index trouble; the prefix credited to a replica only
comes from hashes salted with the current policy version (the caller's ``salt``), so after
``UpdateWeights`` no turn is routed on the strength of KV computed by older weights.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from cache.fingerprint import Fingerprinter
from cache.index import Match, PrefixIndex

PolicyName = Literal["cache_aware", "round_robin", "least_loaded", "sticky", "consistent_hash"]


class RoutingConfig(BaseModel):
    """Turn routing across engine replicas (``Settings.routing``)."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field("cache_aware", description="Routing policy; see placement/policies.py and the README.")
    prefill_weight: float = Field(
        1.0, ge=0, le=100, description="Cost of one uncached prompt token relative to one in-flight token."
    )
    balance_abs_tokens: int = Field(
        16384, ge=0, description="A replica is hot only if its load exceeds the least-loaded one's by this many tokens."
    )
    balance_rel: float = Field(
        1.5, ge=1, le=100, description="... and is more than this many times the least-loaded replica's load."
    )
    group_colocate: bool = Field(True, description="Place every member of a GRPO group on one replica.")
    hash_vnodes: int = Field(64, ge=1, le=4096, description="Virtual nodes per replica on the consistent-hash ring.")
    ring_load_bound: float = Field(
        0.0, ge=0, description="Consistent hash: skip replicas above this x mean load (0 = plain ring, e.g. 1.25)."
    )
    ring_key: Literal["session", "prefix"] = Field(
        "session",
        description="Consistent hash key: session = group id, else episode id; prefix = the first block's hash "
        "(SGLang prefix_hash: one system prompt, one replica).",
    )


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One turn to place. ``hashes`` (block hashes of ``token_ids`` under ``salt``) may be passed precomputed."""

    episode_id: str
    group_id: str = ""
    token_ids: Sequence[int] = ()
    salt: str = ""
    est_tokens: int = 0  # in-flight tokens the turn adds (prompt + max new tokens)
    hashes: Sequence[int] | None = None
    prompt_tokens: int | None = None  # defaults to len(token_ids)
    first_turn: bool = False  # no pin can exist yet: skip the pin look-ups

    @property
    def n_prompt(self) -> int:
        return len(self.token_ids) if self.prompt_tokens is None else self.prompt_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """Where the turn goes and why (``reason`` is a small enum: a metric label)."""

    replica: int
    matched_tokens: int = 0  # prefix tokens the index credits to ``replica``
    reason: str = "load"  # rr | load | sticky | group | ring | cache | shed | fail_open
    hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class RoutingStats:
    decisions: dict[str, int] = field(default_factory=dict)
    predicted_tokens: int = 0  # index-credited prefix tokens of reported turns
    reported_cached_tokens: int = 0  # what engines reported for them
    stale_routes: int = 0  # turns whose credited prefix the engine did not have


class Policy(Protocol):
    name: str
    load: list[int]
    remote: list[int]
    healthy: list[bool]
    stats: RoutingStats

    async def choose(self, req: RouteRequest) -> Decision: ...

    def on_begin(self, replica: int, tokens: int) -> None: ...

    def on_end(self, replica: int, tokens: int) -> None: ...

    async def on_engine_report(
        self, decision: Decision, cached_tokens: int, ok: bool = True, held_hashes: Sequence[int] | None = None
    ) -> None: ...

    async def release(self, episode_id: str = "", group_id: str = "") -> None: ...

    def resize(self, replicas: int) -> None: ...

    def mark(self, replica: int, healthy: bool) -> bool: ...

    async def replica_reset(self, replica: int) -> None: ...


class _Base:
    """Load accounting and the no-op hooks shared by every policy."""

    name = "base"

    def __init__(self, replicas: int) -> None:
        self.load = [0] * replicas  # this bridge's in-flight tokens per replica
        self.remote = [0] * replicas  # other bridges' (a load board refreshes it; zeros without one)
        self.healthy = [True] * replicas  # unhealthy replicas get no turns while a healthy one exists
        self.stats = RoutingStats()
        self._tie = itertools.count()

    def mark(self, replica: int, healthy: bool) -> bool:
        """Record a replica's health (engine call failed / health check); True if that changed it."""
        changed = self.healthy[replica] != healthy
        self.healthy[replica] = healthy
        return changed

    def _up(self, among: Sequence[int] | None = None) -> list[int]:
        cands = list(range(len(self.load))) if among is None else list(among)
        return [r for r in cands if self.healthy[r]] or cands

    def _ok(self, r: int | None) -> bool:
        return r is not None and r < len(self.load) and self.healthy[r]

    def view(self) -> list[int]:
        """Fleet-wide in-flight tokens per replica, as far as this bridge knows."""
        return [a + b for a, b in zip(self.load, self.remote, strict=False)]

    def _decide(self, replica: int, reason: str, matched: int = 0, hashes: Sequence[int] = ()) -> Decision:
        self.stats.decisions[reason] = self.stats.decisions.get(reason, 0) + 1
        return Decision(replica, matched, reason, tuple(hashes))

    def _least_loaded(self, among: Sequence[int] | None = None) -> int:
        cands = self._up(among)
        off = next(self._tie)  # rotate ties so equal replicas share new work
        load = self.view()
        return min(cands, key=lambda r: (load[r], (r + off) % len(load)))

    def on_begin(self, replica: int, tokens: int) -> None:
        self.load[replica] += tokens

    def on_end(self, replica: int, tokens: int) -> None:
        self.load[replica] = max(0, self.load[replica] - tokens)

    async def on_engine_report(
        self, decision: Decision, cached_tokens: int, ok: bool = True, held_hashes: Sequence[int] | None = None
    ) -> None:
        return None

    async def release(self, episode_id: str = "", group_id: str = "") -> None:
        return None

    def resize(self, replicas: int) -> None:
        self.load = (self.load + [0] * replicas)[:replicas]
        self.remote = (self.remote + [0] * replicas)[:replicas]
        self.healthy = (self.healthy + [True] * replicas)[:replicas]

    async def replica_reset(self, replica: int) -> None:
        return None


class RoundRobin(_Base):
    name = "round_robin"

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = itertools.count()

    async def choose(self, req: RouteRequest) -> Decision:
        n = len(self.load)
        for _ in range(n):
            r = next(self._next) % n
            if self.healthy[r]:
                return self._decide(r, "rr")
        return self._decide(next(self._next) % n, "rr")


class LeastLoaded(_Base):
    name = "least_loaded"

    async def choose(self, req: RouteRequest) -> Decision:
        return self._decide(self._least_loaded(), "load")


class StickyEpisode(_Base):
    name = "sticky"

    def __init__(self, replicas: int, group_colocate: bool = True) -> None:
        super().__init__(replicas)
        self.group_colocate = group_colocate
        self._episodes: dict[str, int] = {}
        self._groups: dict[str, int] = {}

    async def choose(self, req: RouteRequest) -> Decision:
        r = self._episodes.get(req.episode_id)
        if r is not None and self._ok(r):
            return self._decide(r, "sticky")
        g = self._groups.get(req.group_id) if req.group_id and self.group_colocate else None
        if g is not None and self._ok(g):
            r, reason = g, "group"
        else:
            r, reason = self._least_loaded(), "load"
            if req.group_id and self.group_colocate:
                self._groups[req.group_id] = r
        self._episodes[req.episode_id] = r
        return self._decide(r, reason)

    async def release(self, episode_id: str = "", group_id: str = "") -> None:
        self._episodes.pop(episode_id, None)
        self._groups.pop(group_id, None)


class ConsistentHash(_Base):
    name = "consistent_hash"

    def __init__(
        self, replicas: int, vnodes: int = 64, load_bound: float = 0.0, key: str = "session", block_size: int = 16
    ) -> None:
        super().__init__(replicas)
        self.vnodes = vnodes
        self.load_bound = load_bound
        self.key = key
        self.fp = Fingerprinter(block_size=block_size)
        self._build()

    def _build(self) -> None:
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"replica-{r}#{v}".encode()), r)
            for r in range(len(self.load))
            for v in range(self.vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def resize(self, replicas: int) -> None:
        super().resize(replicas)
        self._build()

    async def choose(self, req: RouteRequest) -> Decision:
        if self.key == "prefix":
            hashes = req.hashes if req.hashes is not None else self.fp.hashes(req.token_ids, req.salt)
            key = hashes[0].to_bytes(8, "little") if hashes else req.episode_id.encode()
            point = xxhash.xxh3_64_intdigest(key)
        else:
            point = xxhash.xxh3_64_intdigest((req.group_id or req.episode_id).encode())
        i = bisect.bisect(self._points, point) % len(self._points)
        if self.load_bound <= 0:
            for k in range(len(self._points)):  # the first healthy owner clockwise
                r = self._owners[(i + k) % len(self._points)]
                if self.healthy[r]:
                    return self._decide(r, "ring")
            return self._decide(self._owners[i], "ring")
        load = self.view()
        limit = self.load_bound * (sum(load) + req.est_tokens) / len(load)
        for k in range(len(self._points)):
            r = self._owners[(i + k) % len(self._points)]
            if load[r] + req.est_tokens <= limit and self.healthy[r]:
                return self._decide(r, "ring")
        return self._decide(self._least_loaded(), "load")


class CacheAware(_Base):
    name = "cache_aware"

    def __init__(
        self, replicas: int, index: PrefixIndex, fingerprinter: Fingerprinter, config: RoutingConfig | None = None
    ) -> None:
        super().__init__(replicas)
        self.index = index
        self.fp = fingerprinter
        self.cfg = config or RoutingConfig()
        self.pin_ttl_s = 3600.0
        self._episodes: dict[str, int] = {}  # this bridge's own pins (survive index outages)
        self._groups: dict[str, int] = {}
        self._keys: dict[str, str] = {}  # episode / group id -> its current (salted) pin key

    def _hot(self, load: list[int]) -> set[int]:
        lo = min(load)
        return {
            r
            for r, x in enumerate(load)
            if x - lo > self.cfg.balance_abs_tokens and x > self.cfg.balance_rel * (lo + 1)
        }

    def _best(self, cands: Sequence[int], req: RouteRequest, match: Match, load: list[int]) -> int:
        off = next(self._tie)
        n, bs, w = len(load), self.fp.block_size, self.cfg.prefill_weight

        def cost(r: int) -> tuple[float, int, int]:
            uncached = max(0, req.n_prompt - match.tokens(r, bs))
            return (load[r] + req.est_tokens + w * uncached, load[r], (r + off) % n)

        return min(cands, key=cost)

    async def _pinned(self, key: str, local: dict[str, int], first: bool) -> int | None:
        # The shared pin wins (another bridge may have moved the episode); this bridge's own
        # pin is the fallback when the index has none or cannot answer.
        r = None if first else await self.index.pinned(key)
        if r is None:
            r = local.get(key)
        elif local.get(key, r) != r:
            local[key] = r
        return r if self._ok(r) else None

    async def choose(self, req: RouteRequest) -> Decision:
        hashes = list(req.hashes) if req.hashes is not None else self.fp.hashes(req.token_ids, req.salt)
        match = await self.index.lookup(hashes)
        load = self.view()
        hot = self._hot(load)
        reason: str
        # Pins are salted like the hashes: after a weight update no pin (made because a replica
        # held the episode's KV under older weights) steers a turn.
        gkey = f"g:{req.salt}|{req.group_id}" if req.group_id and self.cfg.group_colocate else ""
        ekey = f"e:{req.salt}|{req.episode_id}"
        # 1. GRPO group: one replica for every member, agreed through the index.
        r = await self._pinned(gkey, self._groups, False) if gkey else None
        if r is not None:
            reason = "group"
        else:
            # 2. A continuing episode stays where its KV is, unless that replica is hot.
            p = await self._pinned(ekey, self._episodes, req.first_turn)
            if p is not None and p not in hot:
                r, reason = p, "sticky"
            else:
                up = self._up()
                cands = [x for x in up if x not in hot] or up
                if p is not None:
                    cands = sorted({*cands, p})
                r = self._best(cands, req, match, load)
                if p is not None and r != p:
                    reason = "shed"
                elif not match.ok:
                    reason = "fail_open"
                else:
                    reason = "cache" if match.blocks.get(r, 0) else "load"
            if gkey:
                won = await self.index.pin(gkey, r, self.pin_ttl_s)
                if not self._ok(won):  # pinned to a replica that is down: the group moves
                    await self.index.unpin(gkey)
                    won = await self.index.pin(gkey, r, self.pin_ttl_s)
                r = won if self._ok(won) else r
                self._groups[gkey] = r
        if self._episodes.get(ekey) != r:
            if not req.first_turn:
                await self.index.unpin(ekey)  # shed, or its replica is down: the episode moves
            self._episodes[ekey] = r
            stale = self._keys.get(req.episode_id)
            if stale is not None and stale != ekey:  # pinned under older weights
                self._episodes.pop(stale, None)
            self._keys[req.episode_id] = ekey
            await self.index.pin(ekey, r, self.pin_ttl_s)
        if gkey:
            self._keys[req.group_id] = gkey
        await self.index.record(r, hashes)
        matched = match.blocks.get(r, 0) * self.fp.block_size if match.ok else 0
        return self._decide(r, reason, matched, hashes)

    async def on_engine_report(
        self, decision: Decision, cached_tokens: int, ok: bool = True, held_hashes: Sequence[int] | None = None
    ) -> None:
        bs = self.fp.block_size
        if ok:
            self.stats.predicted_tokens += decision.matched_tokens
            self.stats.reported_cached_tokens += min(cached_tokens, decision.matched_tokens)
            if decision.matched_tokens > cached_tokens + bs:
                self.stats.stale_routes += 1
            await self.index.confirm(decision.replica, held_hashes if held_hashes is not None else decision.hashes)
        else:
            await self.index.drop(decision.replica, decision.hashes[cached_tokens // bs :])

    async def release(self, episode_id: str = "", group_id: str = "") -> None:
        for ident, pins in ((episode_id, self._episodes), (group_id, self._groups)):
            key = self._keys.pop(ident, None) if ident else None
            if key is not None:
                pins.pop(key, None)
                await self.index.unpin(key)

    async def replica_reset(self, replica: int) -> None:
        await self.index.forget_replica(replica)
        self._episodes = {k: v for k, v in self._episodes.items() if v != replica}
        self._groups = {k: v for k, v in self._groups.items() if v != replica}


def make_policy(
    config: RoutingConfig, replicas: int, index: PrefixIndex | None = None, fingerprinter: Fingerprinter | None = None
) -> Policy:
    """The configured policy; ``cache_aware`` needs the prefix index and the fingerprinter."""
    if config.policy == "round_robin":
        return RoundRobin(replicas)
    if config.policy == "least_loaded":
        return LeastLoaded(replicas)
    if config.policy == "sticky":
        return StickyEpisode(replicas, config.group_colocate)
    if config.policy == "consistent_hash":
        bs = fingerprinter.block_size if fingerprinter is not None else 16
        return ConsistentHash(replicas, config.hash_vnodes, config.ring_load_bound, config.ring_key, bs)
    if index is None or fingerprinter is None:
        raise ValueError("the cache_aware policy needs a prefix index and a fingerprinter")
    return CacheAware(replicas, index, fingerprinter, config)
