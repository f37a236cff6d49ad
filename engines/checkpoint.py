"""A weight checkpoint's manifest, read from its safetensors headers without loading a tensor.

The prepare phase of a weight update (``server.weights``) reads the new checkpoint's manifest and checks it
against the served model's before any bridge pauses: every file complete (the safetensors library checks that
the header's offsets cover the file), every tensor of the served model present with the same shape and a
compatible dtype, no tensor the model lacks, the shards of a ``model.safetensors.index.json`` all there. A bad
checkpoint is an INVALID_ARGUMENT naming the file or the tensor, and nothing paused or changed.

``check_weight_dir`` and ``check_adapter_dir``: what an engine that loads from a path (vLLM) needs in a full
checkpoint and in a peft LoRA adapter directory, checked before it is asked.

The manifest also carries a content digest (xxh3-128 over the files' bytes in name order), logged with the update,
so the log says exactly which weights were loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import InvalidArgument

INDEX_FILE = "model.safetensors.index.json"
# An engine casts floating-point weights to its serving dtype on load (a trainer's float32 into a bfloat16 model);
# any other dtype change (an integer tensor, a quantized layout) is a different model.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# A checkpoint may carry ``lm_head.weight`` for a model that ties it to the embeddings (grpo.policy writes the copy:
# vLLM's in-place reload keeps a tied lm_head at its old values otherwise).
TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
_CHUNK = 8 << 20
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a peft adapter directory


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint directory's tensors (name -> (shape, safetensors dtype)), total bytes and digest."""

    path: str
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(repr=False)
    nbytes: int
    digest: str = ""  # "xxh3-128:<hex>" over the files' bytes in name order; "" when not computed


def read_manifest(path: str, digest: bool = False) -> Manifest:
    """Read the manifest of the checkpoint directory ``path``; InvalidArgument names what is wrong with it."""
    from safetensors import SafetensorError, safe_open

    if not path:
        raise InvalidArgument("checkpoint_path is empty: name a directory of *.safetensors files")
    root = Path(path).expanduser()
    try:
        if not root.is_dir():
            raise InvalidArgument(f"checkpoint_path {path!r} is not a directory")
        files = sorted(root.glob("*.safetensors"))
    except OSError as exc:  # e.g. a parent directory the bridge may not search (PermissionError)
        raise InvalidArgument(f"checkpoint_path {path!r} is not readable: {exc}") from None
    if not files:
        raise InvalidArgument(f"checkpoint_path {path!r} has no *.safetensors files")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), "np") as st:
                names = list(st.keys())  # (a safe_open handle is no mapping)
                for name in names:
                    piece = st.get_slice(name)
                    if name in tensors:
                        raise InvalidArgument(f"checkpoint {path!r}: {name} is in both {where[name]} and {f.name}")
                    tensors[name], where[name] = (tuple(piece.get_shape()), piece.get_dtype()), f.name
        except SafetensorError as exc:  # a truncated file: "incomplete metadata, file not fully covered"
            raise InvalidArgument(
                f"checkpoint {path!r}: {f.name} is not a complete safetensors file ({exc}); was it still being written?"
            ) from None
        except OSError as exc:
            raise InvalidArgument(f"checkpoint {path!r}: cannot read {f.name}: {exc}") from None
    _check_index(root, path, where)
    return Manifest(str(root), tensors, sum(f.stat().st_size for f in files), _digest(files) if digest else "")


def _check_index(root: Path, path: str, where: dict[str, str]) -> None:
    """A sharded checkpoint's index must name shards that are there, each holding the tensors it lists."""
    index = root / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of tensor name -> file name")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"checkpoint {path!r}: {INDEX_FILE} is unreadable ({exc})") from None
    absent = sorted(set(weight_map.values()) - set(where.values()))
    if absent:
        raise InvalidArgument(f"checkpoint {path!r}: {INDEX_FILE} names {', '.join(absent)}, which is missing")
    for name, shard in weight_map.items():
        if where.get(name) != shard:
            raise InvalidArgument(f"checkpoint {path!r}: {INDEX_FILE} puts {name} in {shard}, which does not hold it")


def _digest(files: list[Path]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return f"xxh3-128:{h.hexdigest()}"


def check_compatible(new: Manifest, served: Manifest) -> None:
    """Raise InvalidArgument unless ``new`` can replace ``served`` in place: the same tensor names (a copy of
    tied embeddings as ``lm_head.weight`` allowed), the same shapes, dtypes equal or both floating point."""
    extra = [n for n in new.tensors if n not in served.tensors and not _tied_copy(n, new, served)]
    missing = [n for n in served.tensors if n not in new.tensors]
    if missing or extra:
        raise InvalidArgument(
            f"checkpoint {new.path!r} does not match the served model ({served.path}): {len(missing)} tensors "
            f"missing (e.g. {missing[:3]}), {len(extra)} it does not have (e.g. {extra[:3]})"
        )
    for name, (shape, dtype) in new.tensors.items():
        want_shape, want_dtype = served.tensors.get(name) or served.tensors[EMBEDDINGS]
        if shape != want_shape:
            raise InvalidArgument(
                f"checkpoint {new.path!r}: tensor {name} has shape {list(shape)}, the served model's is "
                f"{list(want_shape)} ({_numel(shape):,} vs {_numel(want_shape):,} elements)"
            )
        if dtype != want_dtype and not (dtype in FLOAT_DTYPES and want_dtype in FLOAT_DTYPES):
            raise InvalidArgument(
                f"checkpoint {new.path!r}: tensor {name} is {dtype}, the served model's is {want_dtype}"
            )


def _tied_copy(name: str, new: Manifest, served: Manifest) -> bool:
    return name == TIED_HEAD and EMBEDDINGS in served.tensors and new.tensors.get(EMBEDDINGS) is not None


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def check_weight_dir(path: str) -> Path:
    """Raise InvalidArgument unless ``path`` is a directory with config.json and safetensors weights."""
    if not path:
        raise InvalidArgument("checkpoint_path is empty: name a directory with config.json and *.safetensors")
    d = Path(path)
    if not d.is_dir():
        raise InvalidArgument(f"checkpoint_path {path!r} is not a directory")
    if not (d / "config.json").is_file():
        raise InvalidArgument(f"checkpoint_path {path!r} has no config.json")
    if not any(d.glob("*.safetensors")):
        raise InvalidArgument(f"checkpoint_path {path!r} has no *.safetensors weights")
    return d


# vLLM's packed layers, each matched by the names of the layers it packs (peft's, an adapter's)
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def adapted_modules(manifest: Manifest) -> set[str]:
    """The modules (last name component) a peft adapter's LoRA weights apply to: ``...q_proj.lora_A.weight`` is
    ``q_proj``."""
    return {name.split(".lora_", 1)[0].rsplit(".", 1)[-1] for name in manifest.tensors if ".lora_" in name}


def check_adapter_targets(path: str, modules: set[str], targets: Collection[str]) -> None:
    """InvalidArgument when the adapter has LoRA weights for a module the server does not apply LoRA to: vLLM
    loads such an adapter and silently drops those weights, so it would serve other outputs than the trainer's."""
    allowed = set(targets) | {child for parent in targets for child in PACKED_MODULES.get(parent, ())}
    stray = sorted(modules - allowed)
    if stray:
        raise InvalidArgument(
            f"adapter {path!r} has LoRA weights for {', '.join(stray)}, which the server does not apply LoRA to "
            f"(its --lora-target-modules: {' '.join(targets)}); vLLM would drop them and serve other outputs than "
            "the adapter's: train the adapter without them, or restart the server with them in --lora-target-modules"
        )


def check_adapter_dir(path: str, max_rank: int, targets: Collection[str] | None = None) -> Path:
    """Raise InvalidArgument unless ``path`` is a peft LoRA adapter directory the server can load: adapter_config.json
    (a LoRA of rank at most ``max_rank``; 0: unchecked), adapter_model.safetensors, and LoRA weights only for the
    server's ``targets`` (its ``--lora-target-modules``; None: unrestricted)."""
    if not path:
        raise InvalidArgument("checkpoint_path is empty: name a peft adapter directory (adapter_config.json, weights)")
    d = Path(path)
    if not d.is_dir():
        raise InvalidArgument(f"checkpoint_path {path!r} is not a directory")
    config = d / ADAPTER_CONFIG
    if not config.is_file():
        raise InvalidArgument(f"checkpoint_path {path!r} has no adapter_config.json: not a peft adapter directory")
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{config} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidArgument(f"{config} does not describe a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidArgument(f"{config}: r (the LoRA rank) must be a positive integer, got {rank!r}")
    if max_rank and rank > max_rank:
        raise InvalidArgument(
            f"{config}: rank {rank} exceeds the server's --max-lora-rank {max_rank} (vllm.max_lora_rank); restart "
            "vLLM with a larger one"
        )
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise InvalidArgument(f"checkpoint_path {path!r} has no {ADAPTER_WEIGHTS}")
    manifest = read_manifest(path)  # every file complete
    if targets is not None:
        check_adapter_targets(path, adapted_modules(manifest), targets)
    return d
