"""Run N concurrent multi-turn rollouts with verifiers 0.4.0's own ``TrainClient`` against a base URL.

Runs inside the verifiers virtualenv (``scripts/provision_verifiers.sh``), never the project's: the tests
start it as a subprocess with that venv's python. verifiers is used unmodified, the way its interception
server drives it (``verifiers/v1/interception/server.py``): one shared ``TrainClient``; per rollout a
``Trace`` whose id is the ``X-Session-ID``; per turn ``graph.prepare_turn`` -> ``TrainClient.get_response``
-> ``turn.commit``. The environment is trivial and deterministic: the user says a fixed message each turn
(tagged with the rollout's index so that concurrent sessions have different prompts).

Observation only: an httpx request/response hook on the client's connection pool records what actually
went over the wire (headers, body, raw response), so a test can compare the bridge's trajectory with what
the client sent and received, not just with what verifiers reports.

Output: one JSON line per rollout on stdout::

    {"index": 0, "session_id": "<trace id>", "turns": [{"prompt_ids": [...], "completion_ids": [...],
     "completion_logprobs": [...], "finish_reason": "stop", "content": "...", "sent": {...},
     "received_keys": [...]}, ...], "error": null}

Exit status: 0 when every rollout finished all its turns, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

USER_TURNS = (
    "What is 2+2?",
    "Now add 3 to that.",
    "Say the result in one word.",
)
SYSTEM = "You are a helpful assistant. Answer briefly."
API_KEY_VAR = "PRIMERL_VERIFIERS_API_KEY"  # not PRIME_API_KEY: that one reads the Prime CLI's config


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok)")
    p.add_argument("--model", default="smollm2", help="served model id (the request's `model`)")
    p.add_argument("--renderer-model", required=True, help="local HF directory whose tokenizer renders the chat")
    p.add_argument("--sessions", type=int, default=1, help="concurrent rollouts")
    p.add_argument("--turns", type=int, default=3, help="turns per rollout")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="rollout i samples with seed+i (omitted: no seed)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    return p.parse_args(argv)


def _user_message(index: int, turn: int) -> str:
    return f"[rollout {index}] {USER_TURNS[turn % len(USER_TURNS)]}"


class WireLog:
    """httpx event hooks: what each X-Session-ID sent and got back, in order."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict[str, Any]]] = {}
        self.received: dict[str, list[dict[str, Any]]] = {}

    async def on_request(self, request: Any) -> None:
        if not request.url.path.endswith("/inference/v1/generate"):
            return
        sid = request.headers.get("x-session-id", "")
        self.sent.setdefault(sid, []).append(
            {
                "path": request.url.path,
                "x_session_id": sid,
                "authorization": request.headers.get("authorization", ""),
                "body": json.loads(request.content),
            }
        )

    async def on_response(self, response: Any) -> None:
        if not response.request.url.path.endswith("/inference/v1/generate"):
            return
        await response.aread()
        sid = response.request.headers.get("x-session-id", "")
        try:
            payload = json.loads(response.content)
        except ValueError:
            payload = {"_raw": response.content.decode(errors="replace")}
        self.received.setdefault(sid, []).append({"status": response.status_code, "body": payload})


async def _rollout(client: Any, wire: WireLog, args: argparse.Namespace, index: int) -> dict[str, Any]:
    import verifiers.v1 as vf
    from verifiers.v1 import graph
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import SamplingConfig

    trace = Trace(
        task=TraceTask(type="FixedChat", data={"idx": index}),
        agent=AgentInfo(config=vf.AgentConfig(), name="driver"),
    )
    dialect = ChatDialect()
    sampling: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.seed is not None:
        sampling["seed"] = args.seed + index
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out: dict[str, Any] = {"index": index, "session_id": trace.id, "turns": [], "error": None}
    try:
        for t in range(args.turns):
            messages.append({"role": "user", "content": _user_message(index, t)})
            body = {"model": args.model, "messages": list(messages)}
            request = dialect.parse_request(body)
            turn = graph.prepare_turn(trace, request.messages, request.tools)
            response = await client.get_response(
                dialect, body, SamplingConfig(**sampling), session_id=trace.id, turn=turn
            )
            turn.commit(response)
            tokens = response.tokens
            sent = wire.sent.get(trace.id, [])
            got = wire.received.get(trace.id, [])
            out["turns"].append(
                {
                    "prompt_ids": list(tokens.prompt_ids),
                    "completion_ids": list(tokens.completion_ids),
                    "completion_logprobs": list(tokens.completion_logprobs),
                    "finish_reason": response.finish_reason,
                    "bridged": bool(tokens.bridged),
                    "content": response.message.content,
                    "sent": sent[t] if t < len(sent) else None,
                    "received_keys": sorted(got[t]["body"]) if t < len(got) else None,
                    "received_prompt_token_ids": got[t]["body"].get("prompt_token_ids") if t < len(got) else None,
                }
            )
            # The harness's next request carries the assistant message as the program saw it.
            messages.append(response.raw["choices"][0]["message"])
    except Exception as exc:  # noqa: BLE001 - reported per rollout, the run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=8)
    return out


async def _main(args: argparse.Namespace) -> int:
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig

    root = args.base_url.rstrip("/").removesuffix("/v1")
    config = TrainClientConfig(base_url=f"{root}/v1", api_key_var=API_KEY_VAR, renderer_model_name=args.renderer_model)
    client = TrainClient(config)
    wire = WireLog()
    # The AsyncOpenAI client's httpx pool (observation only; verifiers' code paths are untouched).
    hooks = client.client._client.event_hooks
    hooks["request"].append(wire.on_request)
    hooks["response"].append(wire.on_response)
    t0 = time.monotonic()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(_rollout(client, wire, args, i) for i in range(args.sessions))), args.timeout
        )
    finally:
        await client.close()
    elapsed = time.monotonic() - t0
    failed = 0
    for r in results:
        failed += r["error"] is not None
        print(json.dumps(r), flush=True)
    print(f"[verifiers_driver] {len(results)} rollouts, {failed} failed, {elapsed:.2f} s", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
