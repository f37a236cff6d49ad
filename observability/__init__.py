"""Observability: the bridge's Prometheus metrics and OpenTelemetry traces.

Layout::

    metrics.py    BridgeMetrics: counters, histograms and scrape-time gauges (engine counters, cache, fleet)
    tracing.py    OpenTelemetry setup and the spans of a Step (request id, episode, replica, turn)
    fleet.py      the control plane's own metrics (its calls by method and status code)

It imports ``core`` and ``engines`` (the engine protocol it reads counters from), never ``server``.
"""
