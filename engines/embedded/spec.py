"""Speculative steps of the embedded engine (worker thread): draft, score [pending token + draft] in one
forward, verify exactly (``engines.sampling.verify``) and crop the KV to what was accepted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.types import FinishReason, Origin, TokenChunk, Usage, check_token_ids
from engines.embedded.kvcache import forward_with_cache
from engines.embedded.model import Seq
from engines.sampling import raw_logprob, verify

if TYPE_CHECKING:
    from engines.embedded.engine import EmbeddedEngine


def drafts(engine: EmbeddedEngine, live: list[Seq]) -> dict[Seq, tuple[int, ...]]:
    """Drafts of the sequences that have a drafter and at most one token to feed (others decode plainly)."""
    drafts: dict[Seq, tuple[int, ...]] = {}
    for seq in live:
        drafter = seq.request.drafter
        if drafter is None or seq.request.constraint is not None:
            continue  # constrained mode decodes under its mask, one token per forward
        if len(seq.ids) - seq.cached > 1 or not (seq.in_batch or seq.cache is not None):
            continue
        draft = drafter.draft(seq.ids, seq.budget - seq.produced - 1)
        if draft:
            check_token_ids(draft, engine.info.vocab_size, "draft")
            drafts[seq] = tuple(draft)
    return drafts


def verify_forward(engine: EmbeddedEngine, seq: Seq, draft: tuple[int, ...]) -> list[np.ndarray]:
    """Score [pending token + draft] in one forward; return the len(draft) + 1 next-token logit rows."""
    import torch

    if seq.in_batch:
        engine._unpack()
    assert seq.cache is not None
    feed = ([] if seq.logits is not None else [seq.ids[-1]]) + list(draft)
    out = forward_with_cache(engine.model, seq.cache, input_ids=torch.tensor([feed]), use_cache=True)
    rows = ([seq.logits] if seq.logits is not None else []) + list(out.logits[0])
    seq.cached += len(feed)
    seq.logits = None
    engine.counters.forward_passes += 1
    extra = engine.counters.extra
    extra["spec_forwards"] = extra.get("spec_forwards", 0) + 1
    extra["spec_drafted"] = extra.get("spec_drafted", 0) + len(draft)
    return [r.double().numpy() for r in rows]


def accept(
    engine: EmbeddedEngine, seq: Seq, draft: tuple[int, ...], rows: list[np.ndarray], version: int
) -> TokenChunk:
    """Verify a scored draft, emit the accepted prefix plus one token, crop the KV to what was accepted."""
    params = seq.request.params
    emitted = verify(rows, draft, params, seq.rng)
    accepted = sum(o == Origin.DRAFT_ACCEPTED for _, _, o in emitted)
    assert seq.request.drafter is not None
    seq.request.drafter.feedback(len(draft), accepted)
    engine.counters.extra["spec_accepted"] = engine.counters.extra.get("spec_accepted", 0) + accepted
    ids: list[int] = []
    logprobs: list[float] = []
    origins: list[Origin] = []
    raw: list[float] = []
    reason: FinishReason | None = None
    for i, (token, logprob, origin) in enumerate(emitted):
        ids.append(token)
        logprobs.append(logprob)
        origins.append(origin)
        if params.raw_logprobs:
            raw.append(raw_logprob(rows[i], token))
        seq.ids.append(token)
        seq.produced += 1
        engine.counters.generated_tokens += 1
        if token in seq.stops:
            reason = FinishReason.STOP
        elif seq.produced >= seq.budget:
            reason = FinishReason.LENGTH
        if reason is not None:
            break
    # The KV holds the pending token and the whole draft; keep only the accepted part. The last emitted
    # token is fed at the next step (or next turn), exactly as after a plain sample.
    assert seq.cache is not None
    surplus = seq.cached - (len(seq.ids) - 1)
    if surplus > 0:
        seq.cache.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
    seq.cached = len(seq.ids) - 1
    if reason is None:
        return TokenChunk(tuple(ids), tuple(logprobs), version, tuple(origins), raw_logprobs=tuple(raw))
    seq.finish = reason
    engine._park(seq)
    usage = Usage(prompt_tokens=len(seq.request.token_ids), cached_tokens=seq.reused, generated_tokens=seq.produced)
    return TokenChunk(
        tuple(ids),
        tuple(logprobs),
        version,
        tuple(origins),
        finish_reason=reason,
        usage=usage,
        raw_logprobs=tuple(raw),
    )
