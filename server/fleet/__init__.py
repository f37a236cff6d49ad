"""The fleet: bridges that share one policy version, episodes owned across bridges, the control plane.

Layout::

    member.py     a bridge's membership: heartbeat, version adoption, fleet-wide weight updates
    service.py    the control plane's gRPC service (primerl.v1.Control)
    router.py     replica routing across the fleet's bridges
    ownership.py  which bridge owns an episode; the forwarding interceptor's lookup
    forward.py    forwarding a call to the bridge that owns its episode
    workers.py    several bridge worker processes behind one port
    cli.py        primerl control ...

The fleet changes a bridge only through the bridge's replica API (``Bridge.add_replica``,
``withdraw_replica``, ``restore_replica``).
"""
