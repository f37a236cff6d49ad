"""core.layered_config: each source and its precedence, unknown keys, --dry-run / --help, shipped TOMLs.

Precedence, highest first: overrides > CLI flags > config files (left to right) > environment > defaults.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from core.layered_config import ConfigError, load_config, run_cli, to_toml
from grpo.cli import RLConfig
from grpo.orchestrator import OrchestratorConfig
from grpo.trainer import TrainerConfig
from server.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]


class Ckpt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Save checkpoints.")
    interval: int = Field(0, ge=0, description="Every this many steps.")
    keep_last: int | None = Field(None, description="Keep only the newest this many.")


class Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(10, ge=1, description="Steps.")
    name: str = Field("run", description="Run name.")
    tags: list[str] = Field(default_factory=list, description="Tags.")
    ckpt: Ckpt = Field(default_factory=Ckpt, description="Checkpointing.")


def toml(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_when_no_source_sets_anything() -> None:
    cfg = load_config(Cfg, [], env={})
    assert cfg == Cfg() and cfg.max_steps == 10 and cfg.ckpt.interval == 0


def test_environment_beats_defaults_and_nests_with_double_underscore() -> None:
    env = {"PRIMERL_MAX_STEPS": "7", "PRIMERL_CKPT__INTERVAL": "3", "PRIMERL_TAGS": "a,b", "HOME": "/x"}
    cfg = load_config(Cfg, [], env=env)
    assert (cfg.max_steps, cfg.ckpt.interval, cfg.tags) == (7, 3, ["a", "b"])
    assert load_config(Cfg, [], env={"primerl_ckpt__enabled": "true"}).ckpt.enabled  # names are case-blind
    # Variables of other tools that share the prefix are not ours: ignored, not errors.
    assert load_config(Cfg, [], env={"PRIMERL_VLLM_VENV": "/v", "PRIMERL_VERIFIER__DATABASE_URL": "x"}) == Cfg()


def test_config_file_beats_environment(tmp_path: Path) -> None:
    f = toml(tmp_path, "a.toml", "max_steps = 5\n[ckpt]\ninterval = 2\n")
    env = {"PRIMERL_MAX_STEPS": "7", "PRIMERL_CKPT__INTERVAL": "9", "PRIMERL_NAME": "from-env"}
    cfg = load_config(Cfg, ["@", str(f)], env=env)
    assert (cfg.max_steps, cfg.ckpt.interval, cfg.name) == (5, 2, "from-env")


def test_files_merge_left_to_right_and_deep(tmp_path: Path) -> None:
    a = toml(tmp_path, "a.toml", 'name = "a"\nmax_steps = 5\n[ckpt]\ninterval = 2\nenabled = true\n')
    b = toml(tmp_path, "b.toml", 'name = "b"\n[ckpt]\ninterval = 4\n')
    cfg = load_config(Cfg, ["@", str(a), "@", str(b)], env={})
    assert (cfg.name, cfg.max_steps, cfg.ckpt.interval, cfg.ckpt.enabled) == ("b", 5, 4, True)
    assert load_config(Cfg, ["@", str(b), "@", str(a)], env={}).name == "a"
    assert load_config(Cfg, [f"@{b}"], env={}).name == "b"  # @FILE without the space
    # --section @ FILE loads a file into one section.
    part = toml(tmp_path, "ckpt.toml", "interval = 6\nkeep_last = 2\n")
    cfg = load_config(Cfg, ["@", str(a), "--ckpt", "@", str(part)], env={})
    assert (cfg.ckpt.interval, cfg.ckpt.keep_last, cfg.ckpt.enabled) == (6, 2, True)


def test_command_line_beats_files_and_covers_every_field_kind(tmp_path: Path) -> None:
    a = toml(tmp_path, "a.toml", "max_steps = 5\n[ckpt]\ninterval = 2\nenabled = true\n")
    env = {"PRIMERL_MAX_STEPS": "7"}
    cfg = load_config(Cfg, ["@", str(a), "--max-steps", "6", "--ckpt.interval=3", "--no-ckpt.enabled"], env=env)
    assert (cfg.max_steps, cfg.ckpt.interval, cfg.ckpt.enabled) == (6, 3, False)
    cfg = load_config(Cfg, ["--ckpt.enabled", "--ckpt.keep_last", "2", "--tags", "x", "y"], env={})
    assert (cfg.ckpt.enabled, cfg.ckpt.keep_last, cfg.tags) == (True, 2, ["x", "y"])  # snake or kebab
    assert load_config(Cfg, ["--tags", '["p", "q"]'], env={}).tags == ["p", "q"]


def test_overrides_beat_the_command_line() -> None:
    cfg = load_config(Cfg, ["--max-steps", "6"], env={}, overrides={"max_steps": 8})
    assert cfg.max_steps == 8


@pytest.mark.parametrize(
    ("source", "bad", "nearest"),
    [
        ("file", "[ckpt]\nintervall = 1\n", "ckpt.interval"),
        ("file", "max_step = 1\n", "max_steps"),
        ("env", {"PRIMERL_CKPT__KEEP_LAS": "1"}, "ckpt.keep_last"),
        ("cli", ["--ckpt.intervl", "1"], "ckpt.interval"),
        ("cli", ["--max-stepz", "1"], "max_steps"),
    ],
)
def test_an_unknown_key_names_itself_its_source_and_the_nearest_key(
    tmp_path: Path, source: str, bad: Any, nearest: str
) -> None:
    argv: list[str] = []
    env: dict[str, str] = {}
    if source == "file":
        argv = ["@", str(toml(tmp_path, "bad.toml", bad))]
    elif source == "env":
        env = bad
    else:
        argv = bad
    with pytest.raises(ConfigError) as err:
        load_config(Cfg, argv, env=env)
    msg = str(err.value)
    where = {"file": "bad.toml", "env": "PRIMERL_CKPT__KEEP_LAS", "cli": "command line"}[source]
    assert "unknown config key" in msg and where in msg and f"did you mean '{nearest}'?" in msg, msg


def test_bad_values_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_steps: Input should be greater than or equal to 1 \(got '0'\)"):
        load_config(Cfg, ["--max-steps", "0"], env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, ["@", str(tmp_path / "missing.toml")], env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Cfg, ["@", str(toml(tmp_path, "x.toml", "max_steps = \n"))], env={})
    with pytest.raises(ConfigError, match="unrecognized arguments: stray"):
        load_config(Cfg, ["stray"], env={})


def test_dry_run_prints_toml_that_loads_back_to_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        run_cli(Cfg, ["--max-steps", "4", "--ckpt.keep-last", "1", "--dry-run"], prog="t", env={})
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["max_steps"] == 4
    again = load_config(Cfg, ["@", str(toml(tmp_path, "out.toml", out))], env={})
    assert again == load_config(Cfg, ["--max-steps", "4", "--ckpt.keep-last", "1"], env={})


def test_help_lists_every_field_and_the_merged_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        run_cli(Cfg, ["--help", "--max-steps", "3"], prog="t", env={"PRIMERL_NAME": "envname"})
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-steps", "--name", "--tags", "--ckpt.enabled", "--ckpt.interval", "--ckpt.keep-last"):
        assert flag in out
    resolved = tomllib.loads(out.split("# resolved config (files, environment and flags given with --help)\n")[1])
    assert resolved["max_steps"] == 3 and resolved["name"] == "envname"


def test_a_bad_config_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        run_cli(Cfg, ["--ckpt.intervl", "1"], prog="t", env={})
    assert done.value.code == 2
    assert "did you mean 'ckpt.interval'?" in capsys.readouterr().err


# ---------------------------------------------------------------- the bridge's settings (primerl serve)


def test_bridge_settings_precedence_cli_files_env_defaults(tmp_path: Path) -> None:
    a = toml(tmp_path, "a.toml", '[server]\nport = 1111\nhost = "0.0.0.0"\n[admission]\nmax_episodes = 5\n')
    b = toml(tmp_path, "b.toml", "[admission]\nmax_episodes = 6\n")
    env = {"PRIMERL_SERVER__PORT": "2222", "PRIMERL_METRICS__PORT": "0", "PRIMERL_ADMISSION__MAX_EPISODES": "1"}
    s = load_settings([a, b], argv=["--server.host", "::1"], env=env, http={"port": 0})
    assert s.server.port == 1111  # file beats env
    assert s.metrics.port == 0  # env beats default
    assert s.admission.max_episodes == 6  # later file beats earlier
    assert s.server.host == "::1"  # flag beats file
    assert s.http.port == 0 and s.sampling == Settings().sampling


def test_bridge_env_aliases_of_the_quick_start() -> None:
    env = {"PRIMERL_ENGINE": "vllm", "PRIMERL_ENGINE_BASE_URL": "http://a:1,http://b:2"}
    s = load_settings(env=env)
    assert s.engine.type == "vllm" and s.engine.urls == ["http://a:1", "http://b:2"]
    # The canonical name wins over the alias; a JSON table in PRIMERL_ENGINE still sets the section.
    assert load_settings(env={**env, "PRIMERL_ENGINE__TYPE": "sglang"}).engine.type == "sglang"
    assert load_settings(env={"PRIMERL_ENGINE": '{"type": "toy", "replicas": 2}'}).engine.replicas == 2
    with pytest.raises(ConfigError, match=r"engine\.type: Input should be .toy."):
        load_settings(env={"PRIMERL_ENGINE": "nosuch"})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.main", *args],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_dry_run_keeps_config_and_short_flags_and_takes_every_layer(tmp_path: Path) -> None:
    f = toml(tmp_path, "s.toml", "[server]\nport = 1111\n[http]\nport = 1112\n[metrics]\nport = 1113\n")
    g = toml(tmp_path, "t.toml", "[http]\nport = 2222\n")
    env = {"PRIMERL_ENGINE": "toy", "PRIMERL_METRICS__PORT": "9999", "PRIMERL_REDIS__URL": "redis://e:1"}
    run = _cli("--config", str(f), "@", str(g), "--metrics.port", "3333", "--port", "4444", "--dry-run", env=env)
    assert run.returncode == 0, run.stderr
    out = tomllib.loads(run.stdout)
    assert out["engine"]["type"] == "toy"  # env alias
    assert out["redis"]["url"] == "redis://e:1"  # env, nothing else sets it
    assert out["http"]["port"] == 2222  # @ file after --config file
    assert out["metrics"]["port"] == 3333  # flag beats file and env
    assert out["server"]["port"] == 4444  # the short flag still works
    bad = _cli("--config", str(f), "--http.prot", "1")
    assert bad.returncode == 2 and "did you mean 'http.port'?" in bad.stderr, bad.stderr


# ---------------------------------------------------------------- every TOML shipped in the repo

# Which entry point's schema a shipped TOML is written for, by path prefix (first match wins); a TOML that
# no rule names fails the test below, so a new one must be placed here.
SCHEMAS: list[tuple[str, type[BaseModel]]] = [
    ("examples/bridge", Settings),  # primerl serve
    ("examples/rl/inference", Settings),  # primerl inference (= serve), started by primerl rl --inference @
    ("examples/rl/trainer", TrainerConfig),  # primerl trainer
    ("examples/rl/orchestrator", OrchestratorConfig),  # primerl orchestrator
    ("examples/", RLConfig),  # the other examples (grpo.toml, ppo.toml ...): primerl rl in one process
]
NOT_CONFIGS = {"pyproject.toml"}  # packaging metadata (the repo's, a deploy image's), no entry point reads it


def shipped_tomls() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(p for p in listed if Path(p).name not in NOT_CONFIGS and (REPO / p).is_file())


def test_every_toml_shipped_in_the_repo_loads_under_its_entry_points_schema() -> None:
    files = shipped_tomls()
    assert "examples/bridge.toml" in files
    for rel in files:
        schema = next((cls for prefix, cls in SCHEMAS if rel.startswith(prefix)), None)
        assert schema is not None, f"{rel}: say which entry point reads it in SCHEMAS"
        config = load_config(schema, ["@", str(REPO / rel)], env={})
        assert to_toml(config)  # and it prints back for --dry-run


class Env(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="Environment id.")
    weight: float = Field(1.0, description="Sampling weight.")


class WithEnvs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: list[Env] = Field(default_factory=list, description="Environments.")


def test_arrays_of_tables_are_checked_item_by_item(tmp_path: Path) -> None:
    ok = toml(tmp_path, "ok.toml", '[[env]]\nid = "a"\n[[env]]\nid = "b"\nweight = 2.0\n')
    assert [e.weight for e in load_config(WithEnvs, ["@", str(ok)], env={}).env] == [1.0, 2.0]
    bad = toml(tmp_path, "bad.toml", '[[env]]\nid = "a"\n[[env]]\nid = "b"\nweigth = 2.0\n')
    with pytest.raises(ConfigError, match=r"unknown config key 'env\[1\]\.weigth'.*did you mean 'env\[1\]\.weight'"):
        load_config(WithEnvs, ["@", str(bad)], env={})
