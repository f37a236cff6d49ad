"""The test helper that starts bridge processes (``tests/integration/fleet_bridge.py``) survives a probed port taken
before its child binds it: the child exits (EADDRINUSE), and ``ready()`` starts it again on new ports instead of
waiting out its timeout on a dead process (a 180 s set-up error in a full run, twenty-first session)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from engines.launch import free_port
from tests.integration import fleet_bridge
from tests.integration.fleet_bridge import FleetBridgeProcess


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


async def test_a_child_that_cannot_bind_its_metrics_port_is_started_again_on_new_ports(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([free_port(), taken_port])  # the first child's gRPC port, then its metrics port: already bound
    monkeypatch.setattr(fleet_bridge, "free_port", lambda: next(ports, None) or free_port())
    bridge = FleetBridgeProcess([], {"PRIMERL_ENGINE__TYPE": "toy"})
    first = bridge.proc
    try:
        assert bridge.metrics_port == taken_port
        await bridge.ready(60)
        assert first.poll() not in (None, 0)  # the first child died on the bind
        assert bridge.proc is not first and bridge.metrics_port != taken_port
        assert await bridge.client.server_info()  # the second one serves
    finally:
        await bridge.close()


async def test_a_child_that_keeps_failing_is_reported_with_its_exit_code() -> None:
    bridge = FleetBridgeProcess([], {"PRIMERL_ENGINE__TYPE": "no-such-engine"})
    try:
        with pytest.raises(RuntimeError, match=r"exited with \d+ before SERVING"):
            await bridge.ready(60, respawns=1)
    finally:
        await bridge.close()
