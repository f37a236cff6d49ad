"""Issue 25, acceptance 4: hypothesis-generated config, policy and task files.

Every file a user writes is read by one loader, and for any input the loader either returns a validated value or
raises its one documented error with a message (``ConfigError`` for the bridge's TOML, ``InvalidArgument`` for
sandbox policies, ``TaskFileError`` (FAILED_PRECONDITION: the operator's file) for task files, pydantic's
``ValidationError`` / the grader's errors for LLMServeEnv episode logs): never another exception, never a
traceback in place of a message.

Inputs are built from each schema (real keys with values of any TOML type, unknown keys, wrong nesting) and from
raw bytes (not UTF-8, not TOML, not YAML, not JSON). ``PRIMERL_FUZZ_EXAMPLES`` sets the examples per test.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from core.errors import InvalidArgument
from core.layered_config import ConfigError, _all_paths
from envhub.envs._data import TaskFileError, load_tasks
from sandbox.policies import load_policy
from sandbox.policies.model import SandboxPolicy
from server.config import Settings, load_settings

EXAMPLES = int(os.environ.get("PRIMERL_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "toy", "vllm", "auto", "http://127.0.0.1:1", "/tmp", "0", "-1", "1e9", "none"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _nest(paths: list[str], model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Documents over ``model``'s real key paths (any value each) plus an unknown key now and then."""
    real = st.lists(st.tuples(st.sampled_from(paths), values), max_size=6)
    unknown = st.lists(st.tuples(st.sampled_from(paths).map(lambda p: p + "_x") | st.text(min_size=1), values),
                       max_size=1)  # fmt: skip

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for path, value in pairs:
            *parents, leaf = path.split(".")
            table = doc
            for p in parents:
                nxt = table.setdefault(p, {})
                if not isinstance(nxt, dict):
                    break
                table = nxt
            else:
                table[leaf] = value
        return doc

    return st.builds(lambda a, b: build(a + b), real, unknown)


SETTINGS_PATHS = _all_paths([Settings])


def _write(data: bytes) -> Path:
    fd, name = tempfile.mkstemp(prefix="primerl-fuzz-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)


def _load_settings(data: bytes) -> Settings | None:
    path = _write(data)
    try:
        return load_settings(path, env={})
    except ConfigError as exc:
        assert str(exc).strip(), "an empty error message"
        return None
    finally:
        path.unlink()


@given(_nest(SETTINGS_PATHS, Settings))
@SETTINGS
def test_bridge_toml_with_real_keys_and_any_values(doc: dict[str, Any]) -> None:
    try:
        text = tomli_w.dumps(doc).encode()
    except (TypeError, ValueError):  # a value TOML cannot hold (e.g. None): not a TOML file anyone can write
        return
    _load_settings(text)


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@SETTINGS
def test_bridge_toml_from_raw_bytes(data: bytes) -> None:
    _load_settings(data)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"[server]\nprot = 1\n", "unknown config key 'server.prot'"),
        (b"[server]\nport = 'x'\n", "server.port"),
        (b"server = 3\n", "server"),
        (b"\xff\xfe[", "not valid TOML"),
    ],
)
def test_bridge_toml_errors_name_the_key(text: bytes, says: str) -> None:
    path = _write(text)
    try:
        with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("'", "'")):
            load_settings(path, env={})
    finally:
        path.unlink()


# -- sandbox policies ---------------------------------------------------------------------------------------


POLICY_PATHS = _all_paths([SandboxPolicy])
VALID_POLICY = yaml.safe_load((Path(__file__).parents[2] / "sandbox/policies/default.yaml").read_text())


def _load_policy(data: bytes) -> None:
    path = _write(data)
    try:
        load_policy(str(path))
    except InvalidArgument as exc:
        assert str(exc.message).strip()
    finally:
        path.unlink()


@given(_nest(POLICY_PATHS, SandboxPolicy))
@SETTINGS
def test_policy_yaml_with_real_keys_and_any_values(doc: dict[str, Any]) -> None:
    merged = {**VALID_POLICY, **doc}  # a valid policy with some fields replaced: reaches the cross-field checks
    _load_policy(yaml.safe_dump(merged, allow_unicode=True).encode())
    _load_policy(yaml.safe_dump(doc, allow_unicode=True).encode())


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@SETTINGS
def test_policy_yaml_from_raw_bytes(data: bytes) -> None:
    _load_policy(data)


# -- task files ---------------------------------------------------------------------------------------------

task_rows = st.lists(
    st.dictionaries(st.sampled_from(["task_id", "question", "reference", "extra"]), values, max_size=4) | values,
    max_size=4,
)


def _load_tasks(data: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="primerl-fuzz-tasks-") as tmp:
        (Path(tmp) / "sql_qa.json").write_bytes(data)
        try:
            tasks = load_tasks("sql_qa", tmp)
        except TaskFileError as exc:
            assert "sql_qa.json" in exc.message, exc.message
            return
        assert all(isinstance(t.task_id, str) and isinstance(t.question, str) for t in tasks)


@given(task_rows | values)
@SETTINGS
def test_task_files_as_json(rows: Any) -> None:
    _load_tasks(json.dumps(rows).encode())


def test_task_files_bundled_load_and_bad_ones_name_the_task_and_field(tmp_path: Path) -> None:
    bundled = load_tasks("sql_qa")
    assert len(bundled) > 3
    rows = json.loads((Path(__file__).parents[2] / "envhub/data/tasks/sql_qa.json").read_text())
    (tmp_path / "sql_qa.json").write_text(json.dumps(rows))
    assert load_tasks("sql_qa", str(tmp_path)) == bundled
    rows[1]["reference"] = 3
    (tmp_path / "sql_qa.json").write_text(json.dumps(rows))
    with pytest.raises(TaskFileError, match=r"sql_qa.json: task \[1\]: reference: missing or not a string"):
        load_tasks("sql_qa", str(tmp_path))


@given(st.binary(max_size=200))
@SETTINGS
def test_task_files_from_raw_bytes(data: bytes) -> None:
    _load_tasks(data)


# -- LLMServeEnv episode logs -------------------------------------------------------------------------------


def test_llmserve_episode_logs() -> None:
    from llmserve.agents import make_agent
    from llmserve.grader import EpisodeLogError, grade, run_agent
    from llmserve.models import EpisodeLog
    from llmserve.tasks import TASKS, UnknownTaskError

    valid = run_agent(make_agent("heuristic", 0), next(iter(TASKS)), 0).model_dump(mode="json")
    keys, action_keys = list(valid), list(valid["actions"][0])

    @given(
        st.lists(st.tuples(st.sampled_from(keys), values), max_size=2),
        st.lists(st.tuples(st.sampled_from(action_keys), values), max_size=2),
    )
    @settings(SETTINGS, max_examples=max(10, EXAMPLES // 4))  # each example replays a whole episode
    def one(changes: list[tuple[str, Any]], action_changes: list[tuple[str, Any]]) -> None:
        actions = [{**valid["actions"][0], **dict(action_changes)}, *valid["actions"][1:]]
        doc = {**valid, "actions": actions, **dict(changes)}
        try:
            log = EpisodeLog.model_validate(doc)
        except ValidationError:
            return
        try:
            result = grade(log)
        except (EpisodeLogError, UnknownTaskError) as exc:
            assert str(exc)
            return
        assert 0.0 <= result.score <= 1.0

    one()
