"""Metrics of the control plane (``primerl control serve``), in their own registry.

A bridge's fleet membership counts its registry failures in the bridge's own
``primerl_fail_open_total{component="fleet_registry"}`` (``observability.metrics``); these are the control
plane's: its calls by method and status code.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ControlMetrics:
    """``primerl_control_requests_total{method, code}``: the control plane's RPCs by outcome."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "primerl_control_requests", "Control-plane RPCs by method and status code.", ["method", "code"], registry=r
        )
