"""Transitional: the routing policies moved to ``placement.routing`` (one module per policy).

Kept only while ``server/bridge.py`` (being split concurrently) still imports ``RouteRequest`` and
``RoutingConfig`` from here; delete this module once it imports them from ``placement.routing``.
"""

from __future__ import annotations

from placement.routing import RouteRequest, RoutingConfig

__all__ = ["RouteRequest", "RoutingConfig"]
