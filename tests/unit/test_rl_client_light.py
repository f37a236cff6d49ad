"""A trainer that imports ``rl_client`` gets a light client: no environment variable set, no torch loaded.

``engines/__init__.py`` sets ``OMP_WAIT_POLICY`` for the bridge's torch threads; before issue 34 the client
reached it through ``engines.types`` and changed the trainer's own OpenMP behaviour. Checked in a fresh,
isolated interpreter (``-I``: no user site, no PYTHONPATH) started outside the repository, as a trainer is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os, sys
import rl_client
print(json.dumps({"omp": os.environ.get("OMP_WAIT_POLICY"),
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "engines",
                                                                            "server", "httpx", "starlette"})}))
"""


def test_importing_rl_client_sets_no_environment_variable_and_loads_no_torch(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen == {"omp": None, "loaded": []}


def test_importing_engines_still_sets_it_for_the_bridge(tmp_path) -> None:
    """The probe can fail: the bridge's side of the same check sees the variable set."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = "import os, engines; print(os.environ.get('OMP_WAIT_POLICY'))"
    proc = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.stdout.strip() == "PASSIVE", proc.stderr
