"""Declared sandbox policies (issue 22, acceptance 3): every shipped policy contains the escape suite
under the real bubblewrap sandbox, the suite reports an escape when there is one, a malformed policy is
refused naming the field, and a verdict signs the digest of its grader's policy."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import InvalidArgument
from envhub.envs.code_math import CodeMathEnv
from envhub.envs.sql_qa import SqlQaEnv
from envhub.envs.web_browse import WebBrowseEnv
from envhub.envs.web_lookup import WebLookupEnv
from envhub.graders import FnGrader, get_grader, grader_names, grader_policy_digest, register_grader
from sandbox.check import ATTACKS, check_policy
from sandbox.config import SandboxConfig
from sandbox.policies import SandboxPolicy, load_policy, parse_policy, shipped_policies
from sandbox.runner import CodeSandbox
from server.cli import main
from verifier.config import VerifierConfig
from verifier.service import ScoreRequest, Verifier

ATTACK_NAMES = [a for a, _, _ in ATTACKS]


def test_the_suite_covers_every_attack_of_the_acceptance() -> None:
    assert ATTACK_NAMES == [
        "network egress",
        "write outside the workdir",
        "fork bomb",
        "memory bomb",
        "another process's /proc",
        "ptrace",
        "raising limits",
    ]


@pytest.mark.parametrize("name", shipped_policies())
async def test_each_shipped_policy_contains_the_escape_suite(name: str) -> None:
    outcomes = await check_policy(load_policy(name))
    assert [o.attack for o in outcomes] == ATTACK_NAMES
    assert [o.attack for o in outcomes if not o.contained] == [], outcomes


async def test_the_suite_reports_escapes_without_isolation(tmp_path: Path) -> None:
    """The judges can fail: with rlimits only (no namespaces, no seccomp) the code reaches the host's
    loopback listener, writes into the host directory, reads the decoy's /proc and may ptrace."""
    unisolated = SandboxConfig(isolation="none", allow_unisolated=True, seccomp=False)
    harmless = ["network egress", "write outside the workdir", "another process's /proc", "ptrace", "raising limits"]
    before = set(_escape_files())
    try:
        outcomes = await check_policy(load_policy("default"), unisolated, harmless)
    finally:
        for path in set(_escape_files()) - before:  # a root run wrote into /usr or /: put the host back
            os.remove(path)
    escaped = {o.attack: o.evidence for o in outcomes if not o.contained}
    assert set(escaped) >= {"network egress", "write outside the workdir", "another process's /proc", "ptrace"}
    assert "127.0.0.1" in escaped["network egress"] and "secret was read" in escaped["another process's /proc"]
    assert {o.attack: o.contained for o in outcomes}["raising limits"]  # rlimits still hold without bwrap


def _escape_files() -> list[str]:
    return [p for d in ("/", "/usr", "/etc") for p in glob.glob(os.path.join(d, "escape-*"))]


def test_the_cli_prints_the_table_and_fails_on_a_bad_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sandbox", "check", "grader"]) == 0
    out = capsys.readouterr().out
    assert "7/7 contained" in out and load_policy("grader").digest() in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**_default(), "limits": {**_default()["limits"], "pids": 0}}))
    assert main(["sandbox", "check", str(bad)]) == 2
    assert "limits.pids" in capsys.readouterr().err


def _default() -> dict[str, Any]:
    return load_policy("default").model_dump(mode="json")


def _with(section: str, **fields: Any) -> dict[str, Any]:
    data = _default()
    data[section] = {**data[section], **fields}
    return data


MALFORMED = [
    (_with("limits", cpu_s="lots"), "limits.cpu_s: Input should be a valid integer"),  # wrong type
    (_with("limits", gpus=1), "limits.gpus: Extra inputs are not permitted"),  # unknown field
    ({**_default(), "extra": 1}, "extra: Extra inputs are not permitted"),
    (_with("limits", memory_mb=1), "limits.memory_mb: Input should be greater than or equal to 32"),  # range
    (_with("limits", wall_s=601), "limits.wall_s: Input should be less than or equal to 600"),
    (_with("network", mode="allowlist", hosts=["pypi.org"]), "network.mode: 'allowlist' cannot be enforced"),
    (_with("network", hosts=["pypi.org"]), "network.hosts: must be empty when mode is 'none'"),
    (_with("syscalls", deny=["ptrace", "reboot", "nosuchcall"]), "syscalls.deny: unknown syscall 'nosuchcall'"),
    (_with("syscalls", default="deny"), "syscalls.default: 'deny' (an allowlist profile) cannot be enforced"),
    (_with("filesystem", workdir="/usr"), "filesystem.workdir: '/usr' must be one of the tmpfs or read_write"),
    (_with("filesystem", read_only=["/lib"]), "filesystem.read_only: must include /usr"),
    (_with("filesystem", read_write=["relative/dir"]), "filesystem.read_write.0: 'relative/dir' is not an absolute"),
    (_with("filesystem", read_write=["/usr"]), "filesystem.read_write: '/usr' is mounted twice"),
    (_with("filesystem", tmpfs=[{"path": "/proc/x", "size_mb": 1}]), "filesystem.tmpfs.0.path: '/proc/x' is provided"),
    ({k: v for k, v in _default().items() if k != "syscalls"}, "syscalls: Field required"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED)
def test_a_malformed_policy_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_policy(data, "p.yaml")
    assert f"p.yaml: {message}" in str(err.value)


def test_a_policy_file_that_is_not_a_mapping_or_not_yaml_is_refused(tmp_path: Path) -> None:
    for text, message in (("- a\n- b\n", "a policy is a mapping"), ("limits: [", "not valid YAML")):
        path = tmp_path / "p.yaml"
        path.write_text(text)
        with pytest.raises(InvalidArgument, match=message):
            load_policy(str(path))
    with pytest.raises(InvalidArgument, match="no such file, nor a shipped policy"):
        load_policy("no-such-policy")


def test_the_default_policy_is_the_sandbox_config_defaults_and_explicit_settings_override_it() -> None:
    default = load_policy("default")
    assert CodeSandbox().policy is default and CodeSandbox(SandboxConfig()).policy.digest() == default.digest()
    lim, cfg = default.limits, SandboxConfig()
    assert (lim.cpu_s, lim.wall_s, lim.memory_mb, lim.pids, lim.file_size_mb, lim.open_files) == (
        cfg.cpu_s,
        cfg.wall_s,
        cfg.memory_mb,
        cfg.max_processes,
        cfg.max_file_mb,
        cfg.max_open_files,
    )
    tuned = CodeSandbox(SandboxConfig(cpu_s=1, seccomp=False, workdir_mb=4)).policy
    assert tuned.limits.cpu_s == 1 and tuned.syscalls.deny == () and {m.size_mb for m in tuned.filesystem.tmpfs} == {4}
    assert tuned.digest() != default.digest()  # the digest names what actually runs


def test_every_env_and_grader_declares_a_loadable_policy() -> None:
    for env in (CodeMathEnv, SqlQaEnv, WebLookupEnv, WebBrowseEnv):
        assert env.sandbox_policy in shipped_policies(), env
    for name in ("exact", "constant"):
        assert getattr(get_grader(name), "sandbox_policy", "grader") == "grader"
    for name in grader_names():  # user graders may hold a SandboxPolicy of their own
        assert grader_policy_digest(get_grader(name)).startswith("sha256:")
    with pytest.raises(InvalidArgument, match="no-such-policy"):
        register_grader(FnGrader("test-bad-policy", lambda _: 1.0, sandbox_policy="no-such-policy"))
    assert "test-bad-policy" not in grader_names()


STRICT = SandboxPolicy.model_validate({**_default(), "name": "strict", "limits": {**_default()["limits"], "cpu_s": 1}})
if "test-strict-policy" not in grader_names():  # the registry is process-wide: register once
    register_grader(FnGrader("test-strict-policy", lambda _: 0.25, sandbox_policy=STRICT))


async def test_the_verdict_signs_the_digest_of_the_graders_policy(tmp_path: Path) -> None:
    config = VerifierConfig(database_url=f"sqlite:///{tmp_path / 'log.db'}", key_dir=str(tmp_path / "keys"))
    verifier = await Verifier.open(config)
    traj = {"episode_id": "e", "token_ids": [1], "logprobs": [None], "loss_mask": [0], "origins": [1]}
    try:
        digests = {}
        for grader in ("constant", "test-strict-policy"):
            req = ScoreRequest.model_validate(
                {"grader": grader, "trajectory": {**traj, "policy_versions": [0]}, "params": {"value": 1}}
            )
            digests[grader] = (await verifier.grade(req)).statement()["predicate"]["sandbox_policy_digest"]
    finally:
        await verifier.close()
    assert digests == {"constant": load_policy("grader").digest(), "test-strict-policy": STRICT.digest()}
    assert STRICT.digest().startswith("sha256:") and len(STRICT.digest()) == 71
