"""tests/env_guard.py fails a run that left the editable install pointing away from this checkout."""

from __future__ import annotations

from tests import env_guard


def test_every_installed_package_resolves_into_this_checkout_from_outside_it() -> None:
    locations = env_guard.installed_locations()
    assert set(locations) == set(env_guard.PACKAGES)
    assert env_guard.misplaced(locations) == [], locations


def test_a_package_found_elsewhere_or_not_at_all_is_named() -> None:
    root = env_guard.ROOT
    locations = {
        "server": str(root / "server"),
        "proto": "/tmp/pytest-of-root/pytest-3/test_make_gen_proto0/proto",  # what the gen-proto test once did
        "grpo": "ModuleNotFoundError: No module named 'grpo'",
    }
    assert env_guard.misplaced(locations) == [
        "proto -> /tmp/pytest-of-root/pytest-3/test_make_gen_proto0/proto",
        "grpo -> ModuleNotFoundError: No module named 'grpo'",
    ]


def test_the_packages_are_the_ones_pyproject_installs() -> None:
    import tomllib

    pyproject = tomllib.loads((env_guard.ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {pattern.rstrip("*") for pattern in include} == set(env_guard.PACKAGES)
