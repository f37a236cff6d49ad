"""``ScoreTokens``: teacher-forced logprobs of given tokens on one healthy replica (``engines.scoring``).

No episode, no sampling, no KV kept: the request is validated (InvalidArgument naming the field), refused
with UNIMPLEMENTED when the engine lacks ``Capability.SCORE`` (or the part asked for), and scored on the
least-loaded healthy replica, which counts the tokens as in-flight load while it works. A weight update that is
applying or verifying new weights holds it back until it commits or rolls back (``Weights.stable``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from engines import scoring
from engines.scoring import Scorer, ScoreRequest
from proto.primerl.v1 import primerl_pb2 as pb
from server.bridge import Bridge


async def score_tokens(bridge: Bridge, request: pb.ScoreTokensRequest) -> pb.ScoreTokensResponse:
    _, name = bridge._check_model(request.model, request.adapter)
    req = ScoreRequest(
        token_ids=tuple(request.token_ids),
        start=request.start,
        temperature=request.temperature if request.HasField("temperature") else 1.0,
        return_logits=request.return_logits,
    )
    replicas = bridge.router.replicas
    replica = replicas.least_loaded()
    engine = bridge.engines[replica]
    scoring.validate(req, engine.info)
    adapter = bridge.adapters.acquire(name) if name else None  # held: not unloaded while it scores
    replicas.begin(replica, len(req.token_ids))
    try:
        async with bridge.weights.stable():  # not on weights an update has loaded but not yet committed
            result = await cast(Scorer, engine).score(replace(req, adapter=adapter))
    finally:
        replicas.end(replica, len(req.token_ids))
        if adapter is not None:
            bridge.adapters.release(adapter)
    return pb.ScoreTokensResponse(
        logprobs=result.logprobs.tolist(),
        policy_version=result.policy_version if adapter is None else adapter.version,
        replica=engine.info.replica,
        logits=result.logits.astype("<f4").tobytes() if result.logits is not None else b"",
        vocab_size=engine.info.vocab_size,
    )


__all__ = ["score_tokens"]
