"""The embedded engine's forward passes over its sequences (worker thread): prefill, decode and a draft's verify
forward, in one of two modes picked per engine.

* Default: the Hugging Face model with a ``DynamicCache`` per sequence; sequences that decode one token share one
  forward (their KV left-padded into a batched cache, rebuilt only when the membership changes).
* ``engine.embedded.batch_invariant``: each sequence runs its own fixed-shape forward (``engines.embedded.invariant``),
  so a row's logits never depend on which other sequences decode beside it, on the step it is in, or on KV reuse.

Each pass leaves ``seq.logits`` (the next-token logits after ``seq.ids``) and ``seq.cached`` (positions in the KV)
as the scheduler expects, and counts its work in the engine's counters.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.types import EngineCounters
from engines.embedded.invariant import InvariantCache, forward_rows
from engines.embedded.kvcache import forward_with_cache, new_cache, pack_left, unpack_left
from engines.embedded.lora import LoraBank
from engines.embedded.model import Batch, Seq


def _adapter(seq: Seq) -> str | None:
    adapter = seq.request.adapter
    return adapter.served if adapter is not None else None


def _invariant(seq: Seq) -> InvariantCache:
    """The sequence's KV in deterministic mode (``Seq.cache`` holds an ``InvariantCache`` there)."""
    assert isinstance(seq.cache, InvariantCache)
    return seq.cache


class Passes:
    """The forward passes of one engine; ``batch`` is the decode batch of the default mode (None: unpacked)."""

    def __init__(self, model: Any, counters: EngineCounters, invariant: bool) -> None:
        self.model = model
        self.counters = counters
        self.invariant = invariant
        self.batch: Batch | None = None
        self.lora = LoraBank(model)  # LoRA adapters, each row of a forward on its own (``engines.embedded.lora``)

    def prefill(self, seq: Seq) -> None:
        """Feed the tokens the KV does not cover (all of them without KV); keep the last position's logits."""
        import torch

        if seq.in_batch:
            self.unpack()
        new = seq.ids[seq.cached :]
        if seq.cache is None:
            seq.cache = InvariantCache() if self.invariant else new_cache(self.model.config)  # type: ignore[assignment]
            seq.cached, new = 0, seq.ids
        if seq.produced:  # KV dropped mid-turn by a weight swap: recomputed under the new weights
            self.counters.extra["recomputed_tokens"] = self.counters.extra.get("recomputed_tokens", 0) + len(new)
        with self.lora.rows([_adapter(seq)]):
            if self.invariant:
                seq.logits = forward_rows(self.model, seq.ids, _invariant(seq), rows_from=len(seq.ids) - 1)[0][-1]
            else:
                kw: dict[str, Any] = {"use_cache": True, "logits_to_keep": 1}
                out = forward_with_cache(self.model, seq.cache, input_ids=torch.tensor([new]), **kw)
                seq.logits = out.logits[0, -1]
        seq.cached = len(seq.ids)
        self.counters.forward_passes += 1

    def decode(self, seqs: list[Seq]) -> None:
        """One fed token each (the last sampled): one batched forward, or one forward per sequence (invariant)."""
        import torch

        if self.invariant:  # one forward per sequence: no row's result depends on who else is decoding
            for seq in seqs:
                with self.lora.rows([_adapter(seq)]):
                    seq.logits = forward_rows(self.model, seq.ids, _invariant(seq))[0][-1]
                seq.cached += 1
            self.counters.forward_passes += len(seqs)
            return
        self.counters.forward_passes += 1
        if len(seqs) == 1:
            seq = seqs[0]
            if seq.in_batch:
                self.unpack()
            assert seq.cache is not None
            with self.lora.rows([_adapter(seq)]):
                out = forward_with_cache(self.model, seq.cache, input_ids=torch.tensor([[seq.ids[-1]]]), use_cache=True)
            seq.logits = out.logits[0, -1]
            seq.cached += 1
            return
        if self.batch is None or self.batch.rows != seqs:
            self.unpack()
            self._pack(seqs)
        batch = self.batch
        assert batch is not None
        batch.mask = torch.cat([batch.mask, torch.ones(len(seqs), 1, dtype=batch.mask.dtype)], dim=1)
        with self.lora.rows([_adapter(s) for s in seqs]):
            out = forward_with_cache(
                self.model,
                batch.cache,
                input_ids=torch.tensor([[s.ids[-1]] for s in seqs]),
                attention_mask=batch.mask,
                position_ids=torch.tensor([[s.cached] for s in seqs]),
                use_cache=True,
            )
        for i, seq in enumerate(seqs):
            seq.logits = out.logits[i, -1]
            seq.cached += 1
        self.counters.extra["batched_rows"] = self.counters.extra.get("batched_rows", 0) + len(seqs)

    def verify(self, seq: Seq, draft: tuple[int, ...]) -> list[np.ndarray]:
        """Score [pending token + draft] in one forward; return the len(draft) + 1 next-token logit rows."""
        import torch

        if seq.in_batch:
            self.unpack()
        assert seq.cache is not None
        feed = ([] if seq.logits is not None else [seq.ids[-1]]) + list(draft)
        with self.lora.rows([_adapter(seq)]):
            if self.invariant:
                logits = forward_rows(self.model, seq.ids + list(draft), _invariant(seq))[0]
            else:
                out = forward_with_cache(self.model, seq.cache, input_ids=torch.tensor([feed]), use_cache=True)
                logits = out.logits[0]
        rows = ([seq.logits] if seq.logits is not None else []) + list(logits)
        seq.cached += len(feed)
        seq.logits = None
        self.counters.forward_passes += 1
        extra = self.counters.extra
        extra["spec_forwards"] = extra.get("spec_forwards", 0) + 1
        extra["spec_drafted"] = extra.get("spec_drafted", 0) + len(draft)
        return [r.double().numpy() for r in rows]

    def _pack(self, seqs: list[Seq]) -> None:
        """Left-pad the sequences' KV into one batched cache."""
        caches = []
        for seq in seqs:
            assert seq.cache is not None
            caches.append(seq.cache)
        cache, mask = pack_left(caches, [seq.cached for seq in seqs])
        for seq in seqs:
            seq.cache, seq.in_batch = None, True
        self.batch = Batch(list(seqs), cache, mask)

    def unpack(self) -> None:
        """Split the batched cache back into per-sequence caches."""
        batch, self.batch = self.batch, None
        if batch is None:
            return
        for seq, cache in zip(batch.rows, unpack_left(batch.cache, [s.cached for s in batch.rows]), strict=True):
            seq.cache, seq.in_batch = cache, False
