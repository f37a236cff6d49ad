"""The fleet: bridges that share one policy version, episodes owned across bridges, the control plane.

Layout::

    member.py     a bridge's membership: heartbeat, version adoption, fleet-wide weight updates
    service.py    the control plane's gRPC service (primerl.v1.Control)
    router.py     FleetOwnerInterceptor: a call for another bridge's episode goes to its owner
    ownership.py  which bridge owns an episode; the forwarding interceptor's lookup
    forward.py    forwarding a call to the bridge that owns its episode
    workers.py    several bridge worker processes behind one port
    cli.py        primerl control ...

The fleet changes a bridge only through the bridge's replica API (``Bridge.replicas``: ``add``, ``withdraw``,
``restore``; ``server.replicas``); the bridge knows its membership only as ``server.membership.FleetMembership``
and imports nothing from here.
"""
