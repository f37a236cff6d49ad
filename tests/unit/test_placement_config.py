"""Fleet and model files: bad input gives one clear error naming the field and value (acceptance 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import InvalidArgument
from placement.mig.config import load_fleet, load_models

REPO = Path(__file__).resolve().parents[2]
GOOD_MODEL = "  - name: a\n    config: qwen2.5-7b\n    demand: {tokens_per_s: 1000}\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_examples_load() -> None:
    fleet = load_fleet(REPO / "examples/placement/fleet.yaml")
    assert fleet.gpu_count == 14
    models, archs = load_models(REPO / "examples/placement/models.yaml")
    assert set(archs) == {m.name for m in models.models}


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("nodes:\n  - {name: a, gpu: H100-90GB}\n", ["nodes[0].gpu", "unknown GPU type 'H100-90GB'"]),
        ("nodes:\n  - {name: a, gpu: H100-80GB, count: 0}\n", ["nodes[0].count", "value: 0"]),
        ("nodes:\n  - {name: a, gpu: H100-80GB, count: many}\n", ["nodes[0].count", "'many'"]),
        ("nodes:\n  - {name: a, gpu: H200, colour: red}\n", ["nodes[0].colour", "'red'"]),
        ("nodes:\n  - {name: a, gpu: H200}\n  - {name: a, gpu: B200}\n", ["node name 'a' appears twice"]),
        ("nodes: []\n", ["nodes", "at least 1"]),
        ("gpus: 3\n", ["nodes", "required"]),
        (
            "nodes:\n  - {name: a, gpu: H100-80GB, count: 1, mig_layouts: {0: [4g.40gb, 4g.40gb]}}\n",
            ["nodes[0]", "not a valid H100-80GB MIG geometry"],
        ),
        (
            "nodes:\n  - {name: a, gpu: H100-80GB, count: 1, mig_layouts: {0: [1g.35gb]}}\n",
            ["nodes[0]", "'1g.35gb' is not a H100-80GB MIG profile"],
        ),
        (
            "nodes:\n  - {name: a, gpu: H100-80GB, count: 2, mig_layouts: {5: [7g.80gb]}}\n",
            ["nodes[0]", "GPU index 5"],
        ),
    ],
)
def test_bad_fleet_file_is_one_error_naming_field_and_value(tmp_path: Path, text: str, expect: list[str]) -> None:
    path = write(tmp_path, "fleet.yaml", text)
    with pytest.raises(InvalidArgument) as info:
        load_fleet(path)
    msg = info.value.message
    assert "\n" not in msg
    assert msg.startswith(str(path))
    for part in expect:
        assert part in msg


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (
            "models:\n  - name: a\n    config: qwen2.5-7b\n    demand: {tokens_per_s: -5}\n",
            ["models[0].demand.tokens_per_s", "greater than 0", "value: -5"],
        ),
        (
            "models:\n"
            + GOOD_MODEL
            + "  - name: b\n    config: qwen2.5-7b\n    weight_dtype: int3\n    demand: {tokens_per_s: 1}\n",
            ["models[1].weight_dtype", "'int3'"],
        ),
        ("models:\n  - name: a\n    config: qwen2.5-7b\n", ["models[0].demand", "required"]),
        (
            "models:\n  - name: a\n    config: no-such-model\n    demand: {tokens_per_s: 1}\n",
            ["models[0].config", "'no-such-model'"],
        ),
        (
            "models:\n  - name: a\n    config: {hidden_size: 10}\n    demand: {tokens_per_s: 1}\n",
            ["models[0].config", "num_hidden_layers"],
        ),
        ("models:\n" + GOOD_MODEL + GOOD_MODEL, ["model name 'a' appears twice"]),
        (
            "models:\n  - name: a\n    config: qwen2.5-7b\n    demand: {tokens_per_s: 1, context_len: 8}\n",
            ["models[0].demand.context_len", "value: 8"],
        ),
        ("models: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_bad_models_file_is_one_error_naming_field_and_value(tmp_path: Path, text: str, expect: list[str]) -> None:
    path = write(tmp_path, "models.yaml", text)
    with pytest.raises(InvalidArgument) as info:
        load_models(path)
    msg = info.value.message
    assert msg.startswith(str(path))
    for part in expect:
        assert part in msg


def test_config_json_path_resolves_beside_the_models_file(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((REPO / "placement/mig/model_configs/llama-3.1-8b.json").read_text())
    path = write(
        tmp_path,
        "models.json",
        '{"models": [{"name": "x", "config": "cfg/config.json", "demand": {"tokens_per_s": 5}}]}',
    )
    _, archs = load_models(path)
    assert archs["x"].kv_bytes_per_token() == 128 * 1024


def test_missing_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_fleet(tmp_path / "nope.yaml")
