"""tests/sigterm_guard.py: a SIGTERM'd pytest run tears its fixtures down, so a server started in a process group
of its own (as vLLM, Redis and PostgreSQL are) does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = """
import subprocess, time
from pathlib import Path
import pytest

@pytest.fixture(scope="session")
def server():
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a server in a group of its own
    Path("pid").write_text(str(proc.pid))
    yield
    proc.terminate()
    proc.wait()

def test_long(server):
    time.sleep(120)
"""


def _alive(pid: int, grace_s: float = 0.0) -> bool:
    """Whether ``pid`` still runs after ``grace_s`` (a worker's teardown may end just after its controller)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def _run_and_terminate(tmp_path: Path, *options: str) -> int:
    """Start pytest on SUITE, SIGTERM it (xdist: the controller alone) once the fixture's server runs; the server's
    pid."""
    (tmp_path / "test_suite.py").write_text(SUITE)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", "."]
    args += options
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([*args, "test_suite.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
        time.sleep(0.1)
    pid = int((tmp_path / "pid").read_text())
    run.send_signal(signal.SIGTERM)
    out = run.communicate(timeout=60)[0]
    print(out)
    return pid


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["one process", "xdist"])
def test_a_sigterm_tears_the_fixtures_down(tmp_path: Path, xdist: tuple[str, ...]) -> None:
    pid = _run_and_terminate(tmp_path, "-p", "tests.sigterm_guard", *xdist)
    assert not _alive(pid, grace_s=10)


def test_without_the_guard_the_server_outlives_the_run(tmp_path: Path) -> None:
    """What the guard is for (and why the test above can fail)."""
    pid = _run_and_terminate(tmp_path, "-p", "no:xdist")
    try:
        assert _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
