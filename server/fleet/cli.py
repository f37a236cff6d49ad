"""``primerl control serve`` (the control plane) and ``primerl replicas add|drain|remove|list`` (its admin client).

``primerl replicas add --control HOST:PORT --model M URL [--engine E] [--kv-capacity-tokens N] [--mig-profile P]``
registers a replica of model M (or puts a drained one back in rotation); ``drain`` stops new turns on it (its
in-flight turns finish); ``remove`` takes it out now (its running turns end ABORT, partial tokens kept, and the
episodes continue on the other replicas); ``list`` prints the model's record. Every bridge of the model
converges within one heartbeat. Exit status: 0 done, 2 refused (the message says why).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc


def add_control_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    control = subparsers.add_parser("control", help="the fleet control plane (registry and admin RPCs)")
    sub = control.add_subparsers(dest="control_command", required=True)
    serve = sub.add_parser("serve", help="serve the Control gRPC service (health, reflection, Prometheus)")
    serve.add_argument("--redis-url", default="", help="redis:// URL of the fleet registry (or PRIMERL_REDIS__URL)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind")
    serve.add_argument("--port", type=int, default=50061, help="gRPC port (0 = any free port)")
    serve.add_argument("--metrics-port", type=int, default=9310, help="Prometheus /metrics port (0 = off)")
    serve.add_argument("--key-prefix", default="", help="registry key prefix (default: fleet.key_prefix)")
    serve.add_argument("--log-level", default="INFO", help="logging level")


def add_replicas_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replicas = subparsers.add_parser("replicas", help="add, drain or remove engine replicas of a running fleet")
    sub = replicas.add_subparsers(dest="replicas_command", required=True)
    for name, text in (
        ("add", "register a replica (or put a drained one back in rotation)"),
        ("drain", "send no new turns to a replica; its in-flight turns finish"),
        ("remove", "take a replica out now; its running turns end ABORT with their tokens kept"),
        ("list", "print the model's replicas, version and bridges"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--control", default="127.0.0.1:50061", help="control plane address host:port")
        p.add_argument("--model", required=True, help="served model name")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the control plane")
        if name != "list":
            p.add_argument("url", help="replica base URL, e.g. http://10.0.0.5:8000")
        if name == "add":
            p.add_argument("--engine", default="", help="engine type (vllm, sglang, trtllm)")
            p.add_argument("--kv-capacity-tokens", type=int, default=0, help="KV capacity in tokens (0 = unknown)")
            p.add_argument("--mig-profile", default="", help="MIG profile of its GPU slice, e.g. 3g.40gb")


def run_control(args: argparse.Namespace) -> int:
    import os

    from placement.registry import FleetConfig
    from server.errors import PrimeRLError
    from server.fleet.service import serve_control

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = args.redis_url or os.environ.get("PRIMERL_REDIS__URL", "")
    fleet = FleetConfig(key_prefix=args.key_prefix) if args.key_prefix else FleetConfig()
    try:
        asyncio.run(serve_control(url, args.host, args.port, args.metrics_port, fleet))
    except (PrimeRLError, OSError) as exc:
        print(f"primerl control: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


async def _replicas(args: argparse.Namespace) -> str:
    from proto.primerl.v1 import control_pb2 as cpb
    from proto.primerl.v1 import control_pb2_grpc as cpb_grpc

    async with grpc.aio.insecure_channel(args.control) as channel:
        stub: cpb_grpc.ControlAsyncStub = cpb_grpc.ControlStub(channel)
        if args.replicas_command == "list":
            record = await stub.GetModel(cpb.GetModelRequest(model=args.model), timeout=args.timeout)
        else:
            replica = cpb.FleetReplica(url=args.url)
            if args.replicas_command == "add":
                replica = cpb.FleetReplica(
                    url=args.url,
                    engine=args.engine,
                    kv_capacity_tokens=args.kv_capacity_tokens,
                    mig_profile=args.mig_profile,
                )
            method = {"add": stub.AddReplica, "drain": stub.DrainReplica, "remove": stub.RemoveReplica}
            request = cpb.ReplicaRequest(model=args.model, replica=replica)
            record = await method[args.replicas_command](request, timeout=args.timeout)
    lines = [f"model {record.name}: policy version {record.policy_version}"]
    lines += [f"  replica {r.url} {r.state} {r.engine}".rstrip() for r in record.replicas]
    lines += [f"  bridge {b.id} at {b.address}, {b.load} Steps in flight" for b in record.bridges]
    return "\n".join(lines)


def run_replicas(args: argparse.Namespace) -> int:
    try:
        print(asyncio.run(_replicas(args)))
    except grpc.aio.AioRpcError as exc:
        print(f"primerl replicas {args.replicas_command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    return 0
