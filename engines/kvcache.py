"""KV caches of the embedded engine: transformers' ``DynamicCache`` whose layers append in place.

``DynamicLayer.update`` grows keys and values with ``torch.cat``, copying the whole history on every decode
step: at a 2k-token context that copy was 54% of a SmolLM2-135M decode step on CPU (torch profiler). A
``GrowingLayer`` keeps its keys/values in buffers with spare room and writes new positions in place; the model
sees views of the filled part. Buffers grow by a quarter (at least ``SLACK`` tokens), so copies are amortised.

Everything else treats a layer as transformers does (``layer.keys`` / ``layer.values``): ``crop`` leaves a view
of the same buffer (the next append overwrites the cropped tail, which only this cache references); a layer
whose keys were replaced by other code adopts the new tensor as its buffer on the next append. Caches are never
shared between sequences: forks, packs and unpacks copy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache

SLACK = 256  # tokens of spare room at least, per growth


@functools.cache
def _growing_layer() -> Any:
    """The layer class (built on first use: transformers is imported only when the engine loads)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
            assert keys is not None and values is not None
            n = keys.shape[-2] if keys.dim() == 4 else 0
            need = n + key_states.shape[-2]
            kb, vb = self._kbuf, self._vbuf
            if kb is None or vb is None or kb.shape[-2] < need or not (_view_of(keys, kb) and _view_of(values, vb)):
                cap = need + max(SLACK, need // 4)
                shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
                kb, vb = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    kb[..., :n, :] = keys
                    vb[..., :n, :] = values
                self._kbuf, self._vbuf = kb, vb
            kb[..., n:need, :] = key_states
            vb[..., n:need, :] = value_states
            self.keys, self.values = kb[..., :need, :], vb[..., :need, :]
            return self.keys, self.values

    return GrowingLayer


def new_cache(config: Any = None, data: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A ``DynamicCache`` (layer types from ``config``, or a copy of per-layer ``data``) with growing layers."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=config) if data is None else DynamicCache(ddp_cache_data=data)  # data is copied
    grow = _growing_layer()
    layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:  # sliding-window and other layer types keep their own update
            grown = grow.__new__(grow)
            grown.__dict__.update(layer.__dict__)
            layer = grown
        layers.append(layer)
    cache.layers = layers
    return cache


def _view_of(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` is the leading part (along tokens) of ``buf``, i.e. still this layer's own view."""
    return (
        t.dim() == 4 and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride() and t.shape[:2] == buf.shape[:2]
    )


def kv_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each [batch, kv_heads, tokens, head_dim]; full-attention layers only."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes the cache holds, spare room included (what the KV budget must count)."""
    total = 0
    layers: list[Any] = list(cache.layers)
    for layer in layers:
        k, v = getattr(layer, "_kbuf", None), getattr(layer, "_vbuf", None)
        if k is None or v is None or not (_view_of(layer.keys, k) and _view_of(layer.values, v)):
            k, v = layer.keys, layer.values
        total += int(k.nbytes + v.nbytes) if k is not None and v is not None else 0
    return total


def fork(cache: DynamicCache) -> DynamicCache:
    """An independent copy (a group member continuing from the shared prompt)."""
    return new_cache(data=kv_tensors(cache))
