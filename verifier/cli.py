"""``primerl verifier ...``: serve the verifier, verify its material offline, audit or rotate.

Exit codes: 0 served / verified; 1 verification failed (one line on stderr: which check); 2 bad input
(missing file, malformed JSON, invalid configuration).

Settings: defaults (``VerifierConfig``) < ``[verifier]`` of a TOML ``--config`` file < environment
``PRIMERL_VERIFIER__<FIELD>`` (e.g. ``PRIMERL_VERIFIER__DATABASE_URL``) < flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.errors import PrimeRLError
from verifier.config import VerifierConfig

_ENV = "PRIMERL_VERIFIER__"


def add_verifier_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verifier = subparsers.add_parser("verifier", help="verifier service with a signed, tamper-evident verdict log")
    sub = verifier.add_subparsers(dest="verifier_command", required=True)
    serve = sub.add_parser("serve", help="grade, sign and log verdicts over gRPC and HTTP JSON")
    _store_flags(serve)
    serve.add_argument("--config", metavar="FILE", help="TOML file with a [verifier] table")
    serve.add_argument("--host", help="interface to bind")
    serve.add_argument("--http-port", type=int, help="HTTP JSON port (0 = any free port)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port, primerl.v1.Verifier (0 = any free port)")
    serve.add_argument("--bridge", metavar="HOST:PORT", help="bridge whose episodes Score may end and grade by id")
    serve.add_argument("--origin", help="checkpoint origin / note key name")
    verify = sub.add_parser("verify", help="check an entry, its inclusion proof and a checkpoint offline")
    verify.add_argument("--envelope", required=True, metavar="F", help="entry, receipt, score response or envelope")
    verify.add_argument("--proof", required=True, metavar="F", help="GET /v1/log/proof/inclusion JSON")
    verify.add_argument("--checkpoint", required=True, metavar="F", help="signed checkpoint note (text or JSON)")
    verify.add_argument("--keys", required=True, metavar="F", help="GET /v1/keys JSON")
    verify.add_argument("--origin", help="require this checkpoint origin")
    verify.add_argument("--old-checkpoint", metavar="F", help="an earlier checkpoint the new one must extend")
    verify.add_argument("--consistency", metavar="F", help="GET /v1/log/proof/consistency JSON (with --old-checkpoint)")
    audit = sub.add_parser("audit", help="replay a stored log: every entry, signature and checkpoint")
    _store_flags(audit)
    audit.add_argument("--origin", help="checkpoint origin")
    rotate = sub.add_parser("rotate-key", help="add a signing key and make it active (old entries stay verifiable)")
    rotate.add_argument("--key-dir", help="directory of signing keys")


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", help="sqlite:///PATH or postgresql://...")
    p.add_argument("--key-dir", help="directory of Ed25519 signing keys")


def load_config(args: argparse.Namespace) -> VerifierConfig:
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        data.update(tomllib.loads(Path(args.config).read_text()).get("verifier", {}))
    for name in VerifierConfig.model_fields:
        if _ENV + name.upper() in os.environ:
            data[name] = os.environ[_ENV + name.upper()]
    for name in ("host", "http_port", "grpc_port", "bridge", "database_url", "key_dir", "origin"):
        if getattr(args, name, None) is not None:
            data[name] = getattr(args, name)
    return VerifierConfig.model_validate(data)


def run_verifier(args: argparse.Namespace) -> int:
    try:
        if args.verifier_command == "verify":
            return _verify(args)
        config = load_config(args)
        if args.verifier_command == "serve":
            asyncio.run(serve(config))
        elif args.verifier_command == "audit":
            return _audit(config)
        else:
            from verifier.keys import KeyRing

            key = KeyRing.open(config.key_dir).rotate()
            print(f"active key is now {key.public.keyid} (in {config.key_dir})")
    except (ValidationError, OSError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        print(f"primerl verifier: {exc}", file=sys.stderr)
        return 2
    except PrimeRLError as exc:
        print(f"primerl verifier: {exc.message}", file=sys.stderr)
        return 2
    return 0


async def serve(config: VerifierConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM under the CLI)."""
    import uvicorn

    from verifier.app import create_app
    from verifier.grpc_app import start_grpc
    from verifier.service import Verifier

    verifier = await Verifier.open(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    rpc = None
    try:
        rpc, grpc_port = await start_grpc(verifier, config.host, config.grpc_port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )  # inherited by accepted connections: no 40 ms ACK waits
        sock.bind((config.host, config.http_port))
        sock.listen(2048)  # connections queue from now on, so "ready" is true before uvicorn starts accepting
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(verifier), log_level="warning", lifespan="off"))
        print(
            f"primerl verifier: http://{config.host}:{port} grpc {config.host}:{grpc_port} "
            f"(log {verifier.log.store.backend}, "
            f"{verifier.log.size} entries, key {verifier.log.keyring.active.public.keyid})",
            file=sys.stderr,
            flush=True,
        )
        if ready is not None:
            ready.set()
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="verifier-http")
        with _signals_end_serving():
            try:
                await asyncio.shield(serving)
            except asyncio.CancelledError:  # stop uvicorn the graceful way: it closes its listener and connections
                server.should_exit = True
                await serving
                raise
    finally:
        sock.close()
        if rpc is not None:
            await rpc.stop(grace=1.0)
        await verifier.close()


@contextmanager
def _signals_end_serving() -> Iterator[None]:
    """uvicorn stops on SIGINT/SIGTERM, then re-raises the signal under the handlers it found: make those a
    no-op so the log closes and the command exits 0 instead of dying by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _read_json(path: str) -> Any:
    return json.loads(Path(path).read_text())


def _note(path: str) -> str:
    """A checkpoint file: the note text itself, or GET /v1/log/checkpoint's JSON."""
    text = Path(path).read_text()
    return str(json.loads(text)["note"]) if text.lstrip().startswith("{") else text


def _verify(args: argparse.Namespace) -> int:
    from verifier.verify import VerificationError, parse_keys, verify_consistency, verify_entry

    try:
        keys = parse_keys(_read_json(args.keys))
        entry = verify_entry(
            _read_json(args.envelope), _read_json(args.proof), _note(args.checkpoint), keys, args.origin
        )
        if args.old_checkpoint or args.consistency:
            if not (args.old_checkpoint and args.consistency):
                print("primerl verifier: --old-checkpoint and --consistency go together", file=sys.stderr)
                return 2
            old, _ = verify_consistency(
                _note(args.old_checkpoint), _note(args.checkpoint), _read_json(args.consistency), keys, args.origin
            )
            print(f"consistent: tree size {old.tree_size} -> {entry.checkpoint.tree_size}")
    except VerificationError as exc:
        print(f"primerl verifier: NOT VERIFIED: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as exc:
        print(f"primerl verifier: cannot read the inputs: {exc}", file=sys.stderr)
        return 2
    predicate = entry.statement["predicate"]
    print(
        f"verified: entry {entry.log_index} of {entry.checkpoint.origin} at tree size {entry.checkpoint.tree_size}; "
        f"grader {predicate['grader']['id']} reward {predicate['reward']}"
    )
    return 0


def _audit(config: VerifierConfig) -> int:
    from verifier.store import LogStore
    from verifier.verify import VerificationError, audit

    store = LogStore(config.database_url)
    try:
        size = audit(store, config.origin)
    except VerificationError as exc:
        print(f"primerl verifier: AUDIT FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(f"audited: {size} entries and their checkpoints verify")
    return 0
