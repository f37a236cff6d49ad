"""Settings precedence, shipped config files, and the CLI surface."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.layered_config import ConfigError
from server.cli import _serve_overrides, build_parser
from server.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]


def test_precedence_defaults_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[server]\nport = 1111\nhost = "0.0.0.0"\n[engine]\nreplicas = 3\n[admission]\nmax_episodes = 5\n')
    monkeypatch.setenv("PRIMERL_SERVER__PORT", "2222")
    monkeypatch.setenv("PRIMERL_ADMISSION__MAX_EPISODES", "6")
    s = load_settings(f, admission={"max_episodes": 7})
    assert s.server.port == 1111  # the file beats env (issue 23: CLI > files > env > defaults)
    assert s.server.host == "0.0.0.0"  # file beats default
    assert s.engine.replicas == 3
    assert s.admission.max_episodes == 7  # CLI beats env
    assert s.sampling.max_tokens == Settings().sampling.max_tokens


def test_bad_values_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_episodes"):
        load_settings(admission={"max_episodes": 0})
    f = tmp_path / "c.toml"
    f.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match=r"did you mean 'server\.port'"):
        load_settings(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_every_shipped_bridge_config_file_loads() -> None:
    # Other entry points' TOMLs (examples/grpo.toml: primerl rl) are loaded under their own schema by
    # tests/unit/test_config_layering.py, which covers every TOML in the repo.
    files = sorted((REPO / "examples").glob("**/bridge*.toml"))
    assert files, "examples/ should ship at least one bridge config file"
    for f in files:
        load_settings(f, env={})


def test_every_field_is_documented() -> None:
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(Settings)


def test_cli_flags_are_exactly_the_documented_ones() -> None:
    """Adding a flag must be deliberate: update this list and the README together."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
    flags = sorted(o for a in serve._actions for o in a.option_strings if o.startswith("--"))
    assert flags == [
        "--config",
        "--engine",
        "--engine-url",
        "--help",
        "--host",
        "--http-port",
        "--log-level",
        "--metrics-port",
        "--model",
        "--port",
        "--redis-url",
        "--workers",
    ]
    args = build_parser().parse_args(
        [
            "serve",
            "--engine",
            "vllm",
            "--engine-url",
            "http://a:1,http://b:2",
            "--engine-url",
            "http://c:3",
            "--port",
            "7",
        ]
    )
    assert _serve_overrides(args) == {
        "engine": {"type": "vllm", "urls": ["http://a:1", "http://b:2", "http://c:3"]},
        "server": {"port": 7},
    }
