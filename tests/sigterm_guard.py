"""A pytest plugin that ends the run on SIGTERM as Ctrl-C does, so the servers the fixtures started stop with it.

vLLM servers, Redis, PostgreSQL and bridge children run in process groups of their own (a fixture stops a whole
group); a SIGTERM (CI's time limit, ``timeout``, a killed ``make``) used to end pytest without teardown and leave
them running, holding ports and gigabytes. The handler raises KeyboardInterrupt in pytest's own process (each xdist
worker installs it too, and xdist's controller passes the signal on to its workers, which are its children:
without that, a SIGTERM to the controller alone ended the workers without teardown). pytest then runs every
fixture's teardown and exits 2 (interrupted). A second SIGTERM while that runs is ignored; a process forked from
pytest without exec gets the default action.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import pytest

_PID = os.getpid()
_CONTROLLER = False  # this process is xdist's controller: its children are the workers


def _children() -> list[int]:
    """This process's child processes (Linux: /proc/<pid>/task/<tid>/children)."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _PID:  # a forked child inherited the handler: terminate as it would without it
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    signal.signal(signum, signal.SIG_IGN)  # let the teardown finish
    if _CONTROLLER:
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: tearing the fixtures down")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global _PID, _CONTROLLER
    if threading.current_thread() is threading.main_thread():
        _PID = os.getpid()
        _CONTROLLER = bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")
        signal.signal(signal.SIGTERM, _interrupt)
