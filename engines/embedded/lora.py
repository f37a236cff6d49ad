"""LoRA adapters on the embedded engine: several loaded at once, each row of a forward with its own (or none).

peft applies one adapter to a whole batch (or splits the batch per adapter); the scheduler batches decoding turns of
different episodes, which may sample with different adapters, so the delta is added here, per row, by a forward hook
on each adapted ``nn.Linear``: ``y += (x A^T) (s B)^T`` for the rows on that adapter, where ``s`` is peft's scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), folded into ``B`` at load. The base weights are never changed, so
rows without an adapter (and the KV they cache) are exactly the base model's.

Forwards run on the engine's one worker thread; ``rows`` names each row's adapter around a forward there. A
peft directory is checked on load (``adapter_config.json``: a LoRA without dropout-time-only features we do not
apply; every tensor names a ``nn.Linear`` of the model with matching shapes) and refused with InvalidArgument
naming what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InvalidArgument
from engines.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
_UNSUPPORTED = (
    "use_dora", "modules_to_save", "layers_to_transform", "fan_in_fan_out", "alpha_pattern", "rank_pattern",
)  # fmt: skip


def read_adapter(model: Any, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A peft LoRA directory as module name -> (A [r, in], s*B [out, r]) for ``model``; InvalidArgument otherwise."""
    import torch
    from safetensors.torch import load_file

    d = check_adapter_dir(path, 0)
    cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise InvalidArgument(f"{d / ADAPTER_CONFIG}: {key} = {cfg[key]!r} is not supported by the embedded engine")
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha") or cfg["r"])
    except (TypeError, ValueError):
        raise InvalidArgument(f"{d / ADAPTER_CONFIG}: lora_alpha {cfg.get('lora_alpha')!r} is not a number") from None
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    tensors = load_file(str(Path(d) / ADAPTER_WEIGHTS))
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise InvalidArgument(f"{path}: tensor {key} is not a LoRA A or B weight (lora_A.weight / lora_B.weight)")
        pairs.setdefault(name, {})[part[0]] = t
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, ab in pairs.items():
        layer = modules.get(name)
        if not isinstance(layer, torch.nn.Linear):
            raise InvalidArgument(f"{path}: the adapter targets {name!r}, which is not a linear layer of the model")
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise InvalidArgument(f"{path}: {name} has lora_{'A' if a is None else 'B'}.weight missing")
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise InvalidArgument(
                f"{path}: {name} has A {list(a.shape)} and B {list(b.shape)}; a rank-{rank} LoRA of this layer has "
                f"A [{rank}, {layer.in_features}] and B [{layer.out_features}, {rank}]"
            )
        dtype = layer.weight.dtype
        out[name] = (a.to(dtype).contiguous(), (b.to(torch.float64) * scale).to(dtype).contiguous())
    if not out:
        raise InvalidArgument(f"{path}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return out


class LoraBank:
    """The adapters one embedded engine serves, applied per row by hooks on the model's adapted layers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.adapters: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # served name -> its layers
        self._rows: Sequence[str | None] = ()  # each row's adapter in the forward running now
        self._hooked: set[str] = set()

    def load(self, served: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Serve ``layers`` as ``served`` (worker thread, between two forwards)."""
        modules = dict(self.model.named_modules())
        for name in layers.keys() - self._hooked:
            modules[name].register_forward_hook(self._hook(name))
            self._hooked.add(name)
        self.adapters[served] = layers

    def unload(self, served: str) -> None:
        self.adapters.pop(served, None)

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Around one forward: the adapter of each of its rows (None: the base model)."""
        self._rows = names if any(n is not None for n in names) else ()
        try:
            yield
        finally:
            self._rows = ()

    def _hook(self, name: str) -> Any:
        def add_delta(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            rows = self._rows
            if not rows:
                return None
            x = args[0]
            if x.shape[0] != len(rows):
                raise RuntimeError(f"LoRA rows: a forward of {x.shape[0]} rows was told of {len(rows)}")
            for served in set(rows) - {None}:
                ab = self.adapters.get(served, {}).get(name)  # type: ignore[arg-type]
                if ab is None:
                    continue
                idx = [i for i, r in enumerate(rows) if r == served]
                a, b = ab
                output[idx] += (x[idx] @ a.T) @ b.T
            return output

        return add_delta
