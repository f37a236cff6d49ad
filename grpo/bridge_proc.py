"""A bridge on the embedded engine as a child process (``primerl rl``, the examples and the tests).

The child is ``python -m server serve`` on a free port with metrics and the HTTP front door off; the
context manager waits until it reports SERVING (starting it again on a new port if it exits first) and always stops
it (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from engines.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def bridge_process(
    engine: str = "embedded", extra: Sequence[str] = (), timeout: float = 900.0, log_level: str = "WARNING"
) -> Iterator[str]:
    """Start a bridge child on ``engine``; yields its ``host:port`` once SERVING.

    A child that exits before SERVING is started again on a new port, twice at most (the port is probed free, and
    another process can bind it first); a third exit raises ``RuntimeError`` with its exit code at once, instead of
    waiting ``timeout`` on a dead process."""
    from rl_client import BridgeClient
    from rl_client.errors import BridgeError

    deadline = time.monotonic() + timeout
    for attempt in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "server", "serve", "--engine", engine, "--port", str(port)]
        cmd += ["--metrics-port", "0", "--http-port", "0", "--log-level", log_level, *extra]
        env = os.environ | {"PRIMERL_HTTP__PORT": "0"}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        target = f"127.0.0.1:{port}"
        try:
            with BridgeClient(target, timeout=timeout) as client:
                while proc.poll() is None:
                    left = deadline - time.monotonic()
                    try:
                        client.wait_until_ready(max(0.1, min(2.0, left)))
                        break
                    except BridgeError as exc:  # not SERVING yet: is the child still there?
                        if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED or left <= 2.0:
                            raise
            if proc.poll() is not None:
                if attempt == 2:
                    raise RuntimeError(f"the bridge child ({' '.join(cmd[2:6])}) exited with {proc.returncode}")
                continue
            yield target
            return
        finally:
            terminate(proc)


def terminate(proc: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """Stop a child gracefully (SIGTERM: a bridge drains its Steps), then SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = ["bridge_process", "free_port", "terminate"]
