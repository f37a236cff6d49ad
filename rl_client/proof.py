"""The caller's side of a weight update's proof (``core.proof``): the logprobs the trainer's own copy of the new
weights gives a probe, sent with ``update_weights`` so each replica must match them before the version commits.

    proof = weight_proof(model)  # a transformers causal LM holding the weights just saved
    await client.update_weights(ckpt_dir, proof=proof)

The default probe is the one the bridge uses when none is sent (``core.proof.default_probe``); compute the proof
in float32 (the default tolerance, 0.02 nats, is for fp32 engines) or pass a wider ``tolerance``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.proof import DEFAULT_TOLERANCE, WeightProof, default_probe


def weight_proof(
    model: Any, token_ids: Sequence[int] | None = None, tolerance: float = DEFAULT_TOLERANCE
) -> WeightProof:
    """Score ``token_ids`` (default: the fixed probe for the model's vocabulary) with a Hugging Face causal LM:
    the logprob of each token after the first, given the ones before it, at temperature 1."""
    import torch

    ids = tuple(token_ids) if token_ids is not None else default_probe(int(model.config.vocab_size))
    x = torch.as_tensor(ids, dtype=torch.long)[None]
    with torch.inference_mode():
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).squeeze(-1)
    return WeightProof(ids, tuple(float(v) for v in logprobs.tolist()), tolerance)


__all__ = ["WeightProof", "weight_proof"]
