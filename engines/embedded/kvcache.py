"""KV caches of the embedded engine: transformers' ``DynamicCache`` whose layers append in place.

``DynamicLayer.update`` grows keys and values with ``torch.cat``, copying the whole history on every decode
step: at a 2k-token context that copy was 54% of a SmolLM2-135M decode step on CPU (torch profiler). A
``GrowingLayer`` keeps its keys/values in buffers with spare room and writes new positions in place; the model
sees views of the filled part. Buffers grow by a quarter (at least ``SLACK`` tokens), so copies are amortised.

``KVStore`` parks the caches of idle episodes and GRPO group prompts under a byte budget (LRU), so a later
turn prefills only its new tokens.

Everything else treats a layer as transformers does (``layer.keys`` / ``layer.values``): ``crop`` leaves a view
of the same buffer (the next append overwrites the cropped tail, which only this cache references); a layer
whose keys were replaced by other code adopts the new tensor as its buffer on the next append. Caches are never
shared between sequences: forks, packs and unpacks copy. ``pack_left`` / ``unpack_left`` move per-sequence
caches into one left-padded batch for a shared decode step and back.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.types import EngineCounters
from engines.embedded.invariant import InvariantCache

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache

log = logging.getLogger(__name__)

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


def forward_with_cache(model: Any, cache: DynamicCache | None, **kwargs: Any) -> Any:
    """``model(**kwargs)`` with ``cache`` as its KV cache, under the argument name this transformers expects.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works but warns, and a warning
    is an error in our tests); 5.23 knows only the old name. The name is read off the forward's signature once
    per model class.
    """
    kwargs[_cache_argument(model.__class__)] = cache
    return model(**kwargs)


def output_cache(out: Any) -> DynamicCache:
    """The KV cache a forward returned (``out.cache`` from transformers 5.24, ``out.past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@functools.cache
def _cache_argument(model_class: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


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
    if isinstance(cache, InvariantCache):
        return cache.nbytes()
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
    if isinstance(cache, InvariantCache):
        return cache.fork()  # type: ignore[return-value]
    return new_cache(data=kv_tensors(cache))


def pack_left(caches: list[DynamicCache], lengths: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """One batched cache of the rows' KV, left-padded to the longest, and its [B, T] attention mask (0 = pad).

    ``lengths[i]`` is how many positions row ``i`` holds. The rows are copied; the inputs are left as they are.
    """
    import torch

    width = max(lengths)
    per_row = [kv_tensors(c) for c in caches]
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for li, (k0, v0) in enumerate(per_row[0]):
        _, heads, _, dim = k0.shape
        keys = k0.new_zeros(len(caches), heads, width, dim)
        values = v0.new_zeros(len(caches), heads, width, dim)
        for row, n in enumerate(lengths):
            keys[row, :, width - n :] = per_row[row][li][0][0]
            values[row, :, width - n :] = per_row[row][li][1][0]
        layers.append((keys, values))
    mask = torch.ones(len(caches), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, : width - n] = 0
    return new_cache(data=layers), mask


def unpack_left(cache: DynamicCache, lengths: list[int]) -> list[DynamicCache]:
    """The inverse of ``pack_left`` for rows now ``lengths`` long: one cache per row (copies, so the batch is freed)."""
    kv = kv_tensors(cache)
    width = kv[0][0].shape[-2]
    return [
        new_cache(data=[(k[row : row + 1, :, width - n :], v[row : row + 1, :, width - n :]) for k, v in kv])
        for row, n in enumerate(lengths)
    ]


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share (how much of a parked cache a sequence can reuse)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(slots=True)
class Parked:
    """KV of an idle episode or a group prompt: it covers exactly ``ids``."""

    ids: tuple[int, ...]
    cache: DynamicCache
    logits: torch.Tensor | None  # next-token logits after ``ids``, when known
    salt: str
    deferred: int  # tokens after ``ids`` that this engine sampled (their KV is decode work, not prefill)
    nbytes: int


class KVStore:
    """LRU map of parked KV bounded by bytes. Keys are ``("ep", id)`` or ``("grp", id)``. Thread-safe."""

    def __init__(self, budget: int, counters: EngineCounters) -> None:
        self.budget = budget
        self._items: OrderedDict[tuple[str, str], Parked] = OrderedDict()
        self._lock = threading.Lock()
        self._counters = counters
        self._counters.extra["kv_capacity_bytes"] = budget  # with kv_bytes: the exported KV usage ratio
        self.nbytes = 0

    def put(self, key: tuple[str, str], item: Parked) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes += item.nbytes - (old.nbytes if old else 0)
            self._items[key] = item
            while self.nbytes > self.budget and self._items:
                evicted_key, evicted = self._items.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self._counters.extra["kv_evictions"] = self._counters.extra.get("kv_evictions", 0) + 1
                log.debug("evicted KV of %s %s (%d bytes)", *evicted_key, evicted.nbytes)
            self._counters.extra["kv_bytes"] = self.nbytes

    def take(self, key: tuple[str, str]) -> Parked | None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is not None:
                self.nbytes -= item.nbytes
                self._counters.extra["kv_bytes"] = self.nbytes
            return item

    def peek(self, key: tuple[str, str]) -> Parked | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def clear(self, keep: Callable[[tuple[str, str]], bool] = lambda _: False) -> None:
        with self._lock:
            for key in [k for k in self._items if not keep(k)]:
                self.nbytes -= self._items.pop(key).nbytes
            self._counters.extra["kv_bytes"] = self.nbytes

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._items
