#!/usr/bin/env python3
"""Exit 0 if a bridge's gRPC health service reports SERVING, 1 otherwise (container health checks).

    python scripts/grpc_health.py [ADDRESS] [--service NAME] [--timeout SECONDS]

ADDRESS defaults to 127.0.0.1:${PRIMERL_SERVER__PORT:-50051}. Kubernetes uses its native gRPC
probes instead; this is for ``docker compose`` and the Dockerfile's HEALTHCHECK.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("address", nargs="?", default=f"127.0.0.1:{os.environ.get('PRIMERL_SERVER__PORT', '50051')}")
    parser.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
