"""Dependencies point down: the import-linter contracts of pyproject.toml hold (``make lint`` runs them too).

A library package importing ``server`` (or ``engines`` importing anything above it) fails here with
import-linter's report naming the import chain. The second test proves the check can fail: the same
contracts on a copy of the packages with one wrong-way import added.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
LIBRARY = ("engines", "cache", "placement", "speculation", "grpo", "envhub", "observability")


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return list(config["contracts"])


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(cwd / "pyproject.toml")]
    # PYTHONPATH first: the packages under `cwd` are the ones analysed, not the editable install's.
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_no_library_package_imports_server() -> None:
    forbidding_server = [c for c in _contracts() if c["type"] == "forbidden" and "server" in c["forbidden_modules"]]
    covered = {m for c in forbidding_server for m in c["source_modules"]}
    assert set(LIBRARY) | {"rl_client"} <= covered, f"no contract forbids server to {set(LIBRARY) - covered}"
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_wrong_way_import_breaks_the_contracts(tmp_path: Path) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    for package in (*LIBRARY, "server", "rl_client", "proto"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (tmp_path / "cache" / "wrong_way.py").write_text("from server.errors import status_code\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "Library packages never import server" in result.stdout and "BROKEN" in result.stdout
    assert "cache.wrong_way -> server.errors" in result.stdout
