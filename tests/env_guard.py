"""A pytest plugin that fails the session when the tests changed the environment they ran in.

``make test`` followed by ``make run`` must work: a test that reinstalls the project into ``.venv`` from a
scratch copy (``pip install -e`` from a temporary directory) leaves the editable install pointing there, the
suite still passes (it imports from the repo root) and every later command outside the root fails with
``ModuleNotFoundError``. So at the end of the session a fresh interpreter, started outside the repository,
imports every top-level package the project installs and checks that each one resolves into this checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The packages pyproject.toml's [tool.setuptools.packages.find] installs.
PACKAGES = (
    "core",
    "engines",
    "cache",
    "placement",
    "speculation",
    "sandbox",
    "envhub",
    "observability",
    "rl_client",
    "proto",
    "grpo",
    "evals",
    "verifier",
    "llmserve",
    "server",
)
_wrong = pytest.StashKey[list[str]]()
_PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = str(importlib.import_module(name).__path__[0])
    except Exception as exc:  # report every package, not only the first that fails
        found[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def installed_locations() -> dict[str, str]:
    """Where a fresh interpreter outside the repository finds each package (or why it cannot)."""
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _PROBE, *PACKAGES], cwd=cwd, capture_output=True, text=True, timeout=300
        )
    if proc.returncode != 0:
        return {name: f"probe failed: {proc.stderr.strip()[-500:]}" for name in PACKAGES}
    return dict(json.loads(proc.stdout))


def misplaced(locations: dict[str, str]) -> list[str]:
    return [f"{name} -> {where}" for name, where in locations.items() if Path(where) != ROOT / name]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once
        return
    wrong = misplaced(installed_locations())
    session.config.stash[_wrong] = wrong
    if wrong and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    wrong = config.stash.get(_wrong, [])
    if wrong:
        terminalreporter.section("the tests changed the environment (tests/env_guard.py)", red=True, bold=True)
        terminalreporter.line(
            "outside the repository, a fresh interpreter no longer finds these packages in this checkout"
            " (an editable install was rewritten; rerun `make setup` after fixing the test):",
            red=True,
        )
        for line in wrong:
            terminalreporter.line(f"  {line}", red=True)
