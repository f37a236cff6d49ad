"""The floor under the bridge: a bare ``grpc.aio`` server whose ``Step`` answers at once.

It serves the bridge's own ``PrimeRL/Step`` method (same proto, same server options, the same
"accepted" response headers) and answers with the chunks the bridge would send (one final ``StepChunk``
of 16 tokens; streamed, one per 16 tokens), with no episode, no engine, no routing and no telemetry.
What a Step through the bridge costs beyond this is the bridge; what this costs is Python gRPC on
this machine. ``bench/bridge_overhead.py`` runs it in its
own process, as it runs the bridge, and reports both side by side.

Run alone: ``python -m bench.grpc_floor --port 50099`` (serves until SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto.primerl.v1 import primerl_pb2 as pb
from server.service import ACCEPTED_METADATA

CHUNK = 16  # tokens per chunk of a streamed Step: the toy engine's default yield_every, so the chunks match
TOKENS = list(range(100, 100 + CHUNK))
LOGPROBS = [-1.5] * CHUNK
ORIGINS = [pb.TOKEN_ORIGIN_SAMPLED] * CHUNK
TEXT = "x" * 4 * CHUNK


async def step(request: pb.StepRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepChunk]:
    """``max_tokens`` tokens (16 unless the request sets it): one final chunk, or with ``stream`` one chunk (with
    its text) per 16 tokens, as the bridge streams the toy engine's."""
    await context.send_initial_metadata(ACCEPTED_METADATA)
    n = request.sampling.max_tokens or CHUNK
    if request.stream:
        for _ in range(max(0, (n - 1) // CHUNK)):
            yield pb.StepChunk(token_ids=TOKENS, logprobs=LOGPROBS, origins=ORIGINS, text=TEXT)
    yield pb.StepChunk(
        token_ids=TOKENS,
        logprobs=LOGPROBS,
        origins=ORIGINS,
        done=pb.TurnDone(
            finish_reason=pb.FINISH_REASON_LENGTH,
            policy_version=0,
            text=TEXT * (1 if request.stream else max(1, n // CHUNK)),
            usage=pb.Usage(prompt_tokens=24, generated_tokens=n),
        ),
    )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        step, request_deserializer=pb.StepRequest.FromString, response_serializer=pb.StepChunk.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("primerl.v1.PrimeRL", {"Step": handler}),))
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    asyncio.run(serve(ap.parse_args().port))
