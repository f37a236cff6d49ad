"""``engines.launch.free_ports``: consecutive free ports, picked below the ephemeral range (no client socket's)."""

from __future__ import annotations

import contextlib
import socket

import pytest

from engines import launch
from engines.launch import free_port, free_ports


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_ports_are_free_and_below_the_ephemeral_range(count: int) -> None:
    low = launch._ephemeral_low()
    for _ in range(20):
        base = free_ports(count)
        if low > launch.PORT_FLOOR + count:  # Linux: outside the range outgoing connections draw from
            assert base >= launch.PORT_FLOOR and base + count <= low, (base, low)
        with contextlib.ExitStack() as stack:  # each one binds
            for port in range(base, base + count):
                stack.enter_context(socket.socket()).bind(("127.0.0.1", port))


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # port - 1 .. port + 7 free now, below the ephemeral range: with bind(0)'s port, its neighbours came from the range
    # the suite's client sockets draw from, and port + 7 was once one of them (a full run's flake).
    port = free_ports(9) + 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        picks = iter([port - 1, port, port + 5, port, port + 7])  # pairs from port - 1 and port overlap it
        monkeypatch.setattr(launch.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: 65_000)
        assert free_ports(2) == port + 5
        assert free_port() == port + 7  # port itself is skipped


def test_no_range_below_the_ephemeral_one_falls_back_to_the_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: 0)
    base = free_ports(2)
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", base))
        b.bind(("127.0.0.1", base + 1))
