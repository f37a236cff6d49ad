"""docs/design.md's layout table and the README's name every top-level package of the tree, and no other."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def top_level_packages() -> set[str]:
    """Directories at the root with an ``__init__.py`` (proto's lives one level down: ``proto/primerl``)."""
    found = {p.parent.name for p in REPO.glob("*/__init__.py")}
    return found | {"proto"}


def table_packages(doc: Path) -> set[str]:
    """The packages a markdown table names in its first column: ``| `name/` | ...``."""
    return set(re.findall(r"^\| `([a-z_]+)/` \|", doc.read_text(), flags=re.MULTILINE))


def test_the_tree_has_the_packages_pyproject_installs() -> None:
    include = re.search(r"^include = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert include is not None
    installed = {name.strip().strip('"').rstrip("*") for name in include.group(1).split(",")}
    assert top_level_packages() - {"tests", "bench", "examples"} == installed


def test_design_and_readme_name_every_top_level_package() -> None:
    packages = top_level_packages() - {"tests", "bench", "examples"}
    for doc in (REPO / "docs" / "design.md", REPO / "README.md"):
        named = table_packages(doc)
        assert named == packages, f"{doc.name}: missing {sorted(packages - named)}, stale {sorted(named - packages)}"
