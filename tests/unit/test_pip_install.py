"""``scripts/pip_install.sh``: make setup's and the side virtualenvs' installs, by uv with pip's configuration.

A hand-built wheel that lies only in a find-links directory, with no index allowed (``PIP_FIND_LINKS``,
``PIP_NO_INDEX``: pip's configuration, which uv never reads by itself), is installed into a scratch virtualenv:
by uv when there is one (the wheel's ``INSTALLER`` says who installed it), else (a uv that fails) by pip with the
same arguments. uv's and pip's caches are private to the test.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pip_install.sh"
UV = Path(sys.executable).parent / "uv"


def build_wheel(dest: Path, name: str = "primerl_probe", version: str = "0.1") -> Path:
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    base = tmp_path_factory.mktemp("pip_install")
    links = base / "links"
    links.mkdir()
    build_wheel(links)
    env = os.environ | {
        "PIP_FIND_LINKS": str(links),
        "PIP_NO_INDEX": "1",
        "PIP_NO_CACHE_DIR": "1",
        "UV_CACHE_DIR": str(base / "uv-cache"),
    }
    return base, env


def install(base: Path, env: dict[str, str], name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    target = base / name
    venv.create(target, with_pip=True)  # pip: the script reads pip's configuration through it
    py = target / "bin" / "python"
    proc = subprocess.run(
        [str(SCRIPT), str(py), "-q", "primerl_probe==0.1"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return py, proc


def installer(py: Path) -> str:
    code = "import importlib.metadata as m; print(m.distribution('primerl_probe').read_text('INSTALLER').strip())"
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_uv_installs_from_pips_find_links_with_no_index(scratch: tuple[Path, dict[str, str]]) -> None:
    assert UV.exists(), "uv is a dev dependency (constraints.txt): make setup installs it"
    base, env = scratch
    py, proc = install(base, env | {"PRIMERL_UV": str(UV)}, "with-uv")
    assert installer(py) == "uv", proc.stderr
    assert "uv failed" not in proc.stderr


def test_pip_installs_the_same_when_uv_fails(scratch: tuple[Path, dict[str, str]]) -> None:
    base, env = scratch
    py, proc = install(base, env | {"PRIMERL_UV": "/bin/false"}, "with-pip")
    assert installer(py) == "pip"
    assert "uv failed (above); installing the same with pip" in proc.stderr
