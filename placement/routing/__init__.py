"""Request routing: which engine replica serves each turn (one module per policy).

- ``base``: ``RouteRequest``, ``Decision``, the ``Policy`` protocol (``choose`` required;
  ``observe`` / ``release`` / ``replica_reset`` defaulted by ``PolicyBase``; ``name`` for metrics);
- ``replicas``: ``ReplicaSet``, the replicas' health and in-flight load, which policies read;
- ``round_robin``, ``least_loaded``, ``sticky``, ``consistent_hash``, ``cache_aware``: the policies;
- ``router``: ``Router``, what the bridge calls per turn (policy + prefix index + load board);
- ``config``: ``RoutingConfig`` (``Settings.routing``).

``make_policy`` (``factory``) builds the configured policy. Only ``cache_aware`` needs the prefix index;
without one it runs ``StickyFallback`` (its decisions are counted as ``fallback_sticky``).
"""

from __future__ import annotations

from placement.routing.base import Decision, Policy, PolicyBase, RouteRequest, RoutingStats
from placement.routing.cache_aware import CacheAware
from placement.routing.config import PolicyName, RoutingConfig
from placement.routing.consistent_hash import ConsistentHash
from placement.routing.factory import make_policy
from placement.routing.least_loaded import LeastLoaded
from placement.routing.replicas import ReplicaSet
from placement.routing.round_robin import RoundRobin
from placement.routing.router import Router
from placement.routing.sticky import StickyEpisode, StickyFallback

__all__ = [
    "CacheAware",
    "ConsistentHash",
    "Decision",
    "LeastLoaded",
    "Policy",
    "PolicyBase",
    "PolicyName",
    "ReplicaSet",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "RoutingConfig",
    "RoutingStats",
    "StickyEpisode",
    "StickyFallback",
    "make_policy",
]
