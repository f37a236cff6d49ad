"""Untrusted graders from a real installed distribution's ``primerl.graders`` entry points, run in the sandbox.

The distribution is a real ``*.dist-info`` on ``sys.path`` (what ``pip install`` writes), found by
``importlib.metadata``. Its functions are graded in bubblewrap under the policy they declare: a correct one
scores, one that reaches for the network or the host's files is refused by the sandbox (FAILED_PRECONDITION,
nothing logged), and one that never returns is killed at its deadline (no process left behind).
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from core.errors import PrimeRLError
from envhub.graders import get_grader, grader_policy_digest
from sandbox.policies import load_policy, policy_digest
from tests.integration.test_verifier_http import TRAJECTORY
from verifier.config import VerifierConfig
from verifier.sandboxed import SandboxedGrader
from verifier.service import ScoreRequest, Verifier, load_entry_point_graders

MODULE = '''
"""User graders (untrusted): stdlib only, run in the sandbox."""
import os
import socket

SANDBOX_POLICY = "grader"
GRADER_VERSION = "3"


def sampled_share(sample):
    t = sample["trajectory"]
    return sum(t["loss_mask"]) / len(t["token_ids"]) + sample["params"].get("bonus", 0)


def phone_home(sample):
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    return 1.0


def read_host(sample):
    return float(len(open("/etc/hostname").read()))


def spin(sample):
    while True:
        pass
'''


@pytest.fixture(scope="module")
def user_dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    root = tmp_path_factory.mktemp("site")
    (root / "usergraders_t22.py").write_text(textwrap.dedent(MODULE))
    info = root / "usergraders_t22-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: usergraders-t22\nVersion: 1.0\n")
    names = ["t22-share", "t22-phone", "t22-host", "t22-spin"]
    fns = ["sampled_share", "phone_home", "read_host", "spin"]
    eps = "".join(f"{n} = usergraders_t22:{f}\n" for n, f in zip(names, fns, strict=True))
    (info / "entry_points.txt").write_text(f"[primerl.graders]\n{eps}")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield names
    finally:
        sys.path.remove(str(root))


async def test_entry_point_functions_are_graded_in_the_sandbox(user_dist: list[str], tmp_path: Path) -> None:
    load_entry_point_graders()
    for name in user_dist:
        grader = get_grader(name)
        assert isinstance(grader, SandboxedGrader) and grader.version == "3"
        assert grader_policy_digest(grader) == policy_digest(load_policy("grader"))
    config = VerifierConfig(
        database_url=f"sqlite:///{tmp_path / 'log.sqlite3'}", key_dir=str(tmp_path / "keys"), grader_timeout_s=3.0
    )
    verifier = await Verifier.open(config)
    try:
        share = await verifier.score(
            ScoreRequest.model_validate({"grader": "t22-share", "trajectory": TRAJECTORY, "params": {"bonus": 0.5}})
        )
        assert share.reward == pytest.approx(2 / 5 + 0.5)
        assert share.receipt.log_index == 0
        for name in ("t22-phone", "t22-host"):
            with pytest.raises(PrimeRLError) as err:
                await verifier.score(ScoreRequest.model_validate({"grader": name, "trajectory": TRAJECTORY}))
            assert err.value.code == "FAILED_PRECONDITION", err.value.message
            assert "sandboxed" in err.value.message and "Error" in err.value.message, err.value.message
        before = set(psutil.Process().children(recursive=True))
        with pytest.raises(PrimeRLError) as err:
            await verifier.score(
                ScoreRequest.model_validate({"grader": "t22-spin", "trajectory": TRAJECTORY, "timeout_s": 1.0})
            )
        assert err.value.code == "DEADLINE_EXCEEDED"
        await asyncio.sleep(0.5)
        left = [p for p in psutil.Process().children(recursive=True) if p not in before and p.is_running()]
        assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left  # killed, not left spinning
        assert verifier.log.size == 1  # only the one verdict that was graded
    finally:
        await verifier.close()
