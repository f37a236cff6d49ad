"""The LLMServeEnv Space directory (deploy/spaces/llmserve): what `openenv validate` and a Space build need.

Static checks with the real tools: `openenv validate` (openenv-core, pinned) on the directory, `uv lock --check`
(the lock matches the Space's pyproject and this project's dependencies), hadolint on the CPU-only Dockerfile,
and the Space README's front matter (sdk docker, port 7860, the `openenv` tag).
"""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from tests.unit.test_deploy import ROOT, hadolint, tool

SPACE = ROOT / "deploy" / "spaces" / "llmserve"


def test_openenv_validate_passes_on_the_space_directory() -> None:
    out = subprocess.run(
        [tool("openenv"), "validate", str(SPACE), "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] is True, report
    assert all(report["deployment_modes"].values()), report["deployment_modes"]


def test_uv_lock_is_current() -> None:
    out = subprocess.run(
        [tool("uv"), "lock", "--check", "--project", str(SPACE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"deploy/spaces/llmserve/uv.lock is stale: run `uv lock` there\n{out.stderr}"


def test_dockerfile_passes_hadolint_serves_7860_unprivileged_with_the_web_interface() -> None:
    out = hadolint(SPACE / "Dockerfile")
    assert out.returncode == 0, out.stdout + out.stderr
    text = (SPACE / "Dockerfile").read_text()
    assert "EXPOSE 7860" in text and re.search(r"^USER 10001", text, re.M) and "HEALTHCHECK" in text
    assert "ENABLE_WEB_INTERFACE=true" in text and "llmserve.app:app" in text
    # The image copies every package the project installs (pyproject's packages.find).
    root_copies = set(re.findall(r"^COPY (\w+)/ ", (ROOT / "Dockerfile").read_text(), re.M)) - {"scripts"}
    assert root_copies <= set(re.findall(r"^COPY (\w+)/ ", text, re.M))


def test_readme_front_matter_is_a_docker_space_tagged_openenv() -> None:
    text = (SPACE / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["sdk"] == "docker" and front["app_port"] == 7860 and "openenv" in front["tags"]
    manifest = yaml.safe_load((SPACE / "openenv.yaml").read_text())
    assert manifest["port"] == 7860 and manifest["app"] == "server.app:app"
