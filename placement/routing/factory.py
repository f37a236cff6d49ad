"""``make_policy``: the configured routing policy."""

from __future__ import annotations

from cache.fingerprint import Fingerprinter
from cache.index import PrefixIndex
from placement.routing.base import Policy
from placement.routing.cache_aware import CacheAware
from placement.routing.config import RoutingConfig
from placement.routing.consistent_hash import ConsistentHash
from placement.routing.least_loaded import LeastLoaded
from placement.routing.replicas import ReplicaSet
from placement.routing.round_robin import RoundRobin
from placement.routing.sticky import StickyEpisode, StickyFallback


def make_policy(
    config: RoutingConfig,
    replicas: ReplicaSet | int,
    index: PrefixIndex | None = None,
    fingerprinter: Fingerprinter | None = None,
    pin_ttl_s: float = 3600.0,
) -> Policy:
    """The configured policy over ``replicas``; ``cache_aware`` without an index (or fingerprinter) runs sticky."""
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
        return StickyFallback(replicas, config.group_colocate, instead_of=config.policy)
    return CacheAware(replicas, index, fingerprinter, config, pin_ttl_s)
