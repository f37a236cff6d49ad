"""Placement: which replica serves each turn, which replicas run where, and the fleet's shared record.

Layout::

    registry.py   the fleet registry in Redis: bridges, replicas, each model's policy version, updates
    routing/      routing policies (cache-aware default, sticky, consistent-hash, least-loaded, round-robin)
                  and the Router the bridge calls per turn
    mig/          GPU/MIG inventory and replica placement (``primerl placement plan``)

It imports ``core``, ``engines`` and ``cache``, never the bridge (``server``).
"""
