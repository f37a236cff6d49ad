"""The bridge: the gRPC server, the HTTP front door and the fleet, over one Step path.

Layout::

    bridge.py      Bridge: composes the parts below (StartEpisode, prepare_step, EndEpisode)
    admission.py   in-flight limits, staleness, length
    steps.py       StepHandle: an accepted Step, its stream and the env tool loop
    turns.py       one turn: open, stream the engine into the episode, close
    episodes.py    episode state and store; journaled.py the open episodes with their records and leases
    persistence.py episode records and leases in Redis; envsession.py an episode's env hub session
    weights.py     weight updates and the policy version
    replicas.py    which replicas are in rotation; the replica API the fleet calls (add, withdraw, restore)
    membership.py  FleetMembership: what the bridge asks of its fleet membership (fleet/member.py)
    calls.py       the RPCs' typed requests and results; service.py protobuf <-> bridge
    errors.py      the gRPC side of the one error map (``core.errors``)
    auth.py, telemetry.py, requestid.py, handlers.py   the interceptors and what they share (and the log format)
    app.py         server assembly, health, reflection, lifecycle; config.py the settings root; cli.py ``primerl``
    http/          the HTTP front door (vLLM token route, OpenAI routes, sessions, admin)
    fleet/         fleet membership, the control plane, ownership and forwarding, worker processes

The top layer: it imports every package; none imports it (pyproject.toml's import contracts).
"""
