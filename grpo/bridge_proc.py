"""A bridge on the embedded engine as a child process (``primerl rl``, the examples and the tests).

The child is ``python -m server serve`` on a free port with metrics and the HTTP front door off; the
context manager waits until it reports SERVING and always stops it (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def bridge_process(
    engine: str = "embedded", extra: Sequence[str] = (), timeout: float = 900.0, log_level: str = "WARNING"
) -> Iterator[str]:
    """Start a bridge child on ``engine``; yields its ``host:port`` once SERVING."""
    from rl_client import BridgeClient

    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--engine", engine, "--port", str(port)]
    cmd += ["--metrics-port", "0", "--http-port", "0", "--log-level", log_level, *extra]
    env = os.environ | {"PRIMERL_HTTP__PORT": "0"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    target = f"127.0.0.1:{port}"
    try:
        with BridgeClient(target, timeout=timeout) as client:
            client.wait_until_ready(timeout)
        yield target
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
