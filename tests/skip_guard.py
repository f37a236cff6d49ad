"""A pytest plugin that fails the session when a test is skipped for a reason not allowed.

Services the suite needs (Redis, PostgreSQL, bubblewrap, Chromium) are started privately by
fixtures or installed by ``make setup``; a test that skips because one is missing would turn a
broken machine into a green run. So every skip, at collection or at run time, must match a
reason on ``ALLOWED``: conditions of the hardware, not of what is installed. Anything else
makes the exit status "tests failed", with the offending skips listed at the end.
"""

from __future__ import annotations

import re

import pytest

# Skips that depend on the machine's hardware, never on a missing package or service.
ALLOWED = (
    re.compile(r"this machine has NVML \(a GPU host\)"),
    re.compile(r"the seccomp deny list is built for x86_64"),
)

_offending = pytest.StashKey[list[str]]()


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed(reason: str) -> bool:
    return any(pattern.search(reason) for pattern in ALLOWED)


def _record(config: pytest.Config, report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if not allowed(reason):
            config.stash.setdefault(_offending, []).append(f"{report.nodeid}: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_offending] = []

    class _Recorder:  # a plugin object: the hooks need the config, reports do not carry it
        @staticmethod
        def pytest_runtest_logreport(report: pytest.TestReport) -> None:
            _record(config, report)

        @staticmethod
        def pytest_collectreport(report: pytest.CollectReport) -> None:
            _record(config, report)

    config.pluginmanager.register(_Recorder(), "skip_guard_recorder")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # NO_TESTS_COLLECTED too: a run whose only module was skipped at import must not pass quietly.
    if session.config.stash[_offending] and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    offending = config.stash[_offending]
    if offending:
        terminalreporter.section("skips not allowed (tests/skip_guard.py)", red=True, bold=True)
        terminalreporter.line(f"{len(offending)} skipped for a reason not on the allow-list; the run fails:", red=True)
        for line in offending:
            terminalreporter.line(f"  {line}", red=True)
