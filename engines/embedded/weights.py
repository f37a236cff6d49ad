"""Weight checkpoints for in-place updates of the embedded engine (``UpdateWeights``).

A checkpoint is a directory of ``*.safetensors`` files holding the model's full state dict (a tied
``lm_head.weight`` may be left out). It is read and checked against the model (names, shapes) before any
weight is touched, so a bad checkpoint is an INVALID_ARGUMENT and the engine keeps serving the old weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import InvalidArgument
from engines.checkpoint import read_manifest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def read_checkpoint(model: PreTrainedModel, path: str) -> dict[str, torch.Tensor]:
    """Load and check a safetensors checkpoint against the model (names, shapes) before touching it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(read_manifest(path).path)  # a directory of complete safetensors files (engines.checkpoint)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:
            raise InvalidArgument(f"cannot read {f}: {exc}") from None
    own = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in own if k not in state and not (tied and k == "lm_head.weight")]
    unknown = [k for k in state if k not in own]
    if missing or unknown:
        raise InvalidArgument(
            f"checkpoint {path!r} does not match the model: {len(missing)} tensors missing (e.g. {missing[:3]}), "
            f"{len(unknown)} unexpected (e.g. {unknown[:3]})"
        )
    for k, t in state.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise InvalidArgument(
                f"checkpoint {path!r}: tensor {k} has shape {tuple(t.shape)}, the model needs {tuple(own[k].shape)}"
            )
    return state
