"""``cache_aware`` (the default): each turn goes where its prefix is cached, unless that replica is hot.

- A GRPO group is pinned to one replica, shared through the index so every bridge agrees.
- A continuing episode stays on its pinned replica unless that replica is *hot*.
- Otherwise, among replicas that are not hot: the one with the longest cached prefix when that prefix is over
  ``cache_threshold`` of the prompt (SGLang's rule: a shared system prompt stays on one replica instead of being
  prefilled on each), else the one minimising ``load_r + prefill_weight x (prompt_tokens - cached_prefix_r)``
  (a burst of agents sharing a short header spreads). Hot = ``load_r - min_load > balance_abs_tokens`` and
  ``load_r > balance_rel x (min_load + 1)`` (SGLang's imbalance test, per replica), so a hot
  replica sheds new episodes but keeps the turns whose KV it holds while it is not hot.
- When the index fails open (Redis down or slow) the same formula runs with no cached
  prefixes: load-only routing, and a continuing episode stays on its current replica
  (``RouteRequest.current``, else on this bridge's own pin).

Pins live ``pin_ttl_s`` (``cache.affinity_ttl_s``). Invariants: ``choose`` never raises for
index trouble; the prefix credited to a replica only comes from hashes salted with the
current policy version (the caller's ``salt``), and so are the pins, so after
``UpdateWeights`` no turn is routed on the strength of KV computed by older weights.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.fingerprint import Fingerprinter
from cache.index import Match, PrefixIndex
from placement.routing.base import Decision, PolicyBase, RouteRequest
from placement.routing.config import RoutingConfig
from placement.routing.replicas import ReplicaSet


class CacheAware(PolicyBase):
    name = "cache_aware"

    def __init__(
        self,
        replicas: ReplicaSet | int,
        index: PrefixIndex,
        fingerprinter: Fingerprinter,
        config: RoutingConfig | None = None,
        pin_ttl_s: float = 3600.0,
    ) -> None:
        super().__init__(replicas)
        self.index = index
        self.fp = fingerprinter
        self.cfg = config or RoutingConfig()
        self.pin_ttl_s = pin_ttl_s  # cache.affinity_ttl_s
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

    def _best(self, cands: Sequence[int], req: RouteRequest, match: Match, load: list[int], hot: set[int]) -> int:
        off = self.replicas.tie()
        n, bs, w = len(load), self.fp.block_size, self.cfg.prefill_weight

        def cost(r: int) -> tuple[float, int, int]:
            uncached = max(0, req.n_prompt - match.tokens(r, bs))
            return (load[r] + req.est_tokens + w * uncached, load[r], (r + off) % n)

        # The threshold rule is for replicas that are not hot: a hot pinned replica among the candidates (its episode
        # may stay if moving costs more) is weighed by cost only, or it would always win on its own history.
        cached = {r: match.tokens(r, bs) for r in cands if r not in hot}
        top = max(cached.values(), default=0)
        if top and top > self.cfg.cache_threshold * req.n_prompt:
            return min((r for r in cached if cached[r] == top), key=cost)
        return min(cands, key=cost)

    def _reserve(self, req: RouteRequest, r: int, match: Match) -> None:
        self.replicas.reserve(req.episode_id, r, req.est_tokens - match.tokens(r, self.fp.block_size))

    async def _pinned(self, key: str, local: dict[str, int], first: bool, current: int | None = None) -> int | None:
        # The shared pin wins (another bridge may have moved the episode); this bridge's own pin is
        # the fallback when the index has none. When the index cannot answer (it failed open), the
        # episode's current replica (its persisted record, which every bridge reads) comes first:
        # another bridge may have moved the episode since, and two bridges each sticking to a
        # different pin would move it back and forth every turn.
        failed = self.index.stats.fail_open
        r = None if first else await self.index.pinned(key)
        if r is None:
            r = current if current is not None and self.index.stats.fail_open > failed else local.get(key)
        elif local.get(key, r) != r:
            local[key] = r
        return r if self.replicas.ok(r) else None

    async def choose(self, req: RouteRequest) -> Decision:
        hashes = list(req.hashes) if req.hashes is not None else self.fp.hashes(req.token_ids, req.salt)
        match = await self.index.lookup(hashes)
        reason: str
        # Pins are salted like the hashes: after a weight update no pin (made because a replica
        # held the episode's KV under older weights) steers a turn.
        gkey = f"g:{req.salt}|{req.group_id}" if req.group_id and self.cfg.group_colocate else ""
        ekey = f"e:{req.salt}|{req.episode_id}"
        # 1. GRPO group: one replica for every member, agreed through the index.
        r = await self._pinned(gkey, self._groups, False) if gkey else None
        if r is not None:
            reason = "group"
            match = self.index.recent(match, hashes)  # (the group's earlier members, recorded since the lookup)
        else:
            # 2. A continuing episode stays where its KV is, unless that replica is hot.
            p = await self._pinned(ekey, self._episodes, req.first_turn, req.current)
            # What this bridge routed since the lookup was asked counts too: a burst over one prefix (a system
            # prompt, a header) finds where its first turn went, before Redis shows it (``cache/recent.py``).
            match = self.index.recent(match, hashes)
            load = self.replicas.view()  # read after the last await: decisions made meanwhile are counted in it
            hot = self._hot(load)
            if p is not None and p not in hot:
                r, reason = p, "sticky"
            else:
                up = self.replicas.up()
                cands = [x for x in up if x not in hot] or up
                if p is not None:
                    cands = sorted({*cands, p})
                r = self._best(cands, req, match, load, hot)
                if p is not None and r != p:
                    reason = "shed"
                elif not match.ok:
                    reason = "fail_open"
                else:
                    reason = "cache" if match.blocks.get(r, 0) else "load"
            # Counted before the next await: a burst of first turns sharing a header would otherwise all see the
            # same loads and the header's provisional entry, and all choose one replica.
            self._reserve(req, r, match)
            if gkey:
                won = await self.index.pin(gkey, r, self.pin_ttl_s)
                if not self.replicas.ok(won):  # pinned to a replica that is down: the group moves
                    await self.index.unpin(gkey)
                    won = await self.index.pin(gkey, r, self.pin_ttl_s)
                r = won if self.replicas.ok(won) else r
                self._groups[gkey] = r
                self._reserve(req, r, match)
            else:
                # Recorded before the next await too: a turn over the same prefix decided meanwhile (while this
                # one's pin goes to Redis) finds it through ``recent``, not on the other replica. A group member
                # records once its group's replica is agreed (below).
                await self.index.record(r, hashes)
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
        return self._decide(r, reason, matched, hashes, req.n_prompt)

    async def observe(
        self,
        decision: Decision,
        cached_tokens: int,
        ok: bool = True,
        held_hashes: Sequence[int] | None = None,
        learned: bool = True,
    ) -> None:
        bs = self.fp.block_size
        if ok:
            self.stats.predicted_tokens += decision.matched_tokens
            self.stats.reported_cached_tokens += min(cached_tokens, decision.matched_tokens)
            if decision.matched_tokens > cached_tokens + bs:
                self.stats.stale_routes += 1
            cacheable = max(0, decision.prompt_tokens - 1) // bs * bs
            credit, got = min(decision.matched_tokens, cacheable), cached_tokens // bs * bs
            outcome = "exact" if credit == got else "over" if credit > got else "under"
            self.stats.predictions[outcome] = self.stats.predictions.get(outcome, 0) + 1
            if learned:
                await self.index.confirm(decision.replica, held_hashes if held_hashes is not None else decision.hashes)
            # Else the replica's KV events confirm what it stored and evict what it drops, provisional entries
            # included; an event may arrive after the turn ends (vLLM publishes from its engine process), so
            # routing's provisional entries stay until then (or expire after cache.provisional_ttl_s).
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
