"""Dependencies point down and no package's files import in a circle (docs/design.md, "Layout").

Two independent checks of one rule:

* the import-linter contracts of pyproject.toml (``make lint`` runs them too): ``core`` imports nothing of
  ours, ``engines`` only ``core``, ``rl_client`` only ``core`` and ``proto``, ``envhub`` no product or
  server, the layers from the bridge down to ``core``, and no circle between siblings of any package;
* the import graph built here with grimp (what import-linter uses), ``TYPE_CHECKING`` imports included:
  every arrow between two packages must run down the layer order, and no set of modules may import each
  other in a circle.

Each check is shown able to fail on a copy of the tree with one wrong import added: a library module
importing the bridge, and a ``TYPE_CHECKING`` import of a module that imports back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES: list[str] = list(CONFIG["root_packages"])


def _contracts() -> list[dict[str, Any]]:
    return list(CONFIG["contracts"])


def _layers() -> list[set[str]]:
    """The layer order of the layers contract, top first: each layer a set of packages."""
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    return [{name.strip() for name in layer.replace(":", "|").split("|")} for layer in layers]


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(cwd / "pyproject.toml")]
    # PYTHONPATH first: the packages under `cwd` are the ones analysed, not the editable install's.
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False)


def graph_violations(root: Path) -> list[str]:
    """Wrong-way arrows between packages and circles between modules, for the packages under ``root``.

    Runs in a child interpreter with ``root`` first on the path, so a copy of the tree is analysed as itself.
    """
    code = f"import sys; sys.path.insert(0, {str(root)!r}); from tests.unit.test_layering import _violations; "
    code += "print('\\n'.join(_violations()))"
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line]


def _violations() -> list[str]:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    rank = {package: depth for depth, layer in enumerate(_layers()) for package in layer}
    out = []
    edges: dict[str, set[str]] = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    for importer, imported in sorted((a, b) for a, bs in edges.items() for b in bs):
        up, down = importer.split(".")[0], imported.split(".")[0]
        if up != down and rank[up] >= rank[down]:  # same layer, or a lower layer importing a higher one
            out.append(f"arrow back up: {importer} -> {imported} ({up} may not import {down})")
    for circle in _circles(edges):
        out.append("circle: " + " -> ".join(circle))
    return out


def _circles(edges: dict[str, set[str]]) -> Iterable[list[str]]:
    """Each strongly connected set of modules (more than one), as a path around it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append([*sorted(members), min(members)])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _copy_tree(tmp_path: Path) -> Path:
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    for package in (*PACKAGES, "tests"):
        ignore = shutil.ignore_patterns("__pycache__", "data", "*.sqlite", "*.json", "*.yaml")
        shutil.copytree(REPO / package, tmp_path / package, ignore=ignore)
    return tmp_path


def test_the_contracts_cover_every_layer_and_are_kept() -> None:
    names = {c["name"] for c in _contracts()}
    kinds = {c["type"] for c in _contracts()}
    assert {"forbidden", "layers", "acyclic_siblings"} <= kinds
    forbidden = {
        src: set(c["forbidden_modules"])
        for c in _contracts()
        if c["type"] == "forbidden"
        for src in c["source_modules"]
    }
    ours = set(PACKAGES)
    assert forbidden["core"] == ours - {"core"}
    assert forbidden["engines"] == ours - {"core", "engines"}
    assert forbidden["rl_client"] == ours - {"core", "proto", "rl_client"}
    assert {"grpo", "rl_client", "proto", "server"} <= forbidden["envhub"]
    assert set().union(*_layers()) == ours, "every package has a layer"
    assert _layers()[0] == {"server"} and _layers()[-1] == {"core"}
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in names:
        assert " ".join(name.split()) in " ".join(result.stdout.split()), f"lint-imports did not check {name!r}"
    assert "BROKEN" not in result.stdout


def test_no_arrow_back_up_and_no_circle() -> None:
    assert graph_violations(REPO) == []


def test_a_wrong_way_import_breaks_both_checks(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    (root / "cache" / "wrong_way.py").write_text("from server.errors import status_code\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "cache.wrong_way -> server.errors" in result.stdout
    assert "arrow back up: cache.wrong_way -> server.errors (cache may not import server)" in graph_violations(root)


@pytest.mark.parametrize(
    ("module", "back_import"),
    [
        # wire.py is imported by vllm.py; a type-only import of vllm from wire closes a circle.
        ("engines/http/wire.py", "from engines.http.vllm import VllmEngine"),
    ],
)
def test_a_back_importing_type_checking_import_is_a_circle(tmp_path: Path, module: str, back_import: str) -> None:
    root = _copy_tree(tmp_path)
    path = root / module
    text = path.read_text()
    assert "from engines.http.wire import" in (root / "engines/http/vllm.py").read_text()  # the import back
    path.write_text(text + f"\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    {back_import}\n")
    result = _lint(root)
    assert result.returncode != 0 and "No cycles are allowed in engines.http" in result.stdout
    assert any(v.startswith("circle:") and "engines.http.wire" in v for v in graph_violations(root))
