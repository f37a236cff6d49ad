"""``primerl``: the command line (``primerl serve ...``; ``python -m server`` is the same)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any

from core.layered_config import run_cli
from engines.config import EngineType
from engines.launch import add_engine_parser, run_engine_command
from evals.cli import add_eval_parser, run_eval_command
from grpo.commands import COMMANDS as RL_COMMANDS
from grpo.commands import add_rl_parsers
from llmserve.cli import add_llmserve_parser, run_llmserve
from placement.mig.cli import add_placement_parser, run_placement
from sandbox.check import add_sandbox_parser, run_sandbox
from server.config import ENV_ALIASES, Settings
from server.fleet.cli import add_control_parser, add_replicas_parser, run_control, run_replicas
from server.requestid import configure_logging
from verifier.cli import add_verifier_parser, run_verifier


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags as nested settings overrides (only the flags given)."""
    out: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            out.setdefault(section, {})[key] = value

    put("engine", "type", args.engine)
    put("engine", "urls", [u for arg in args.engine_url for u in arg.split(",") if u] if args.engine_url else None)
    put("engine", "model", args.model)
    put("server", "host", args.host)
    put("server", "port", args.port)
    put("http", "port", args.http_port)
    put("metrics", "port", args.metrics_port)
    put("redis", "url", args.redis_url)
    put("server", "workers", args.workers)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primerl", description="PrimeRL-ServeKit: RL inference bridge.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        aliases=["inference"],  # prime-rl's name for it (primerl rl --inference @ i.toml starts it)
        help="run the gRPC bridge",
        add_help=False,  # --help also lists every layered setting (core.layered_config)
        allow_abbrev=False,  # --engine.type and friends go to the layered config, never to --engine
        description="Every setting is also a flag (--section.key VALUE), config files load with @ FILE.toml "
        "(several merge left to right), PRIMERL_SECTION__KEY variables are read; precedence: flags > files > "
        "environment > defaults. --dry-run prints the resolved settings as TOML and exits.",
    )
    serve.add_argument("-h", "--help", action="store_true", help="show this help and every setting, then exit")
    serve.add_argument("--config", metavar="FILE", help="TOML settings file (the same as @ FILE)")
    serve.add_argument("--engine", choices=EngineType.__args__, help="engine implementation")  # type: ignore[attr-defined]
    serve.add_argument(
        "--engine-url", action="append", metavar="URL", help="engine replica URL (repeat or comma-separate)"
    )
    serve.add_argument("--model", help="model name (or local model directory for the embedded engine)")
    serve.add_argument("--host", help="interface to bind")
    serve.add_argument("--port", type=int, help="gRPC port (0 = any free port)")
    serve.add_argument("--http-port", type=int, help="HTTP front door port (OpenAI / vLLM routes; 0 = off)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = off)")
    serve.add_argument("--redis-url", help="redis:// URL of the shared index")
    serve.add_argument("--workers", type=int, help="bridge processes sharing the port (default 1)")
    serve.add_argument("--log-level", default="INFO", help="logging level")
    serve.set_defaults(serve_help=serve.format_help)
    add_placement_parser(sub)
    add_verifier_parser(sub)
    add_eval_parser(sub)
    add_llmserve_parser(sub)
    add_sandbox_parser(sub)
    add_engine_parser(sub)
    add_rl_parsers(sub)
    add_control_parser(sub)
    add_replicas_parser(sub)
    token = sub.add_parser(
        "hash-token", help="print an auth entry TENANT:SHA256HEX for a bearer token read from stdin (or --new)"
    )
    token.add_argument("tenant", help="tenant the token belongs to")
    token.add_argument("--new", action="store_true", help="generate a random token (printed once, on stderr)")
    inspect = sub.add_parser(
        "inspect", help="print (and open, where a browser can) the live inspector page of a bridge"
    )
    inspect.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the bridge's HTTP front door")
    inspect.add_argument("--no-open", action="store_true", help="only print the URL")
    sub.add_parser(
        "bench",
        add_help=False,
        help="run the benchmark matrix from a source checkout (bench/matrix.py; `primerl bench --help`)",
    )
    return parser


def _bench(argv: list[str]) -> int:
    """``primerl bench``: the matrix lives in the checkout's bench/ (not installed); run it from there."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "matrix.py").is_file():
        print(
            f"primerl bench: no bench/matrix.py next to {root / 'server'}; run it from a source checkout "
            "installed with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, "-m", "bench.matrix", *argv], cwd=root)


def _hash_token(args: argparse.Namespace) -> int:
    import secrets

    from server.auth import hash_token

    if not args.tenant.strip() or ":" in args.tenant:
        print("primerl: the tenant must be non-empty and contain no ':'", file=sys.stderr)
        return 2
    if args.new:
        value = secrets.token_urlsafe(32)
        print(f"token (give it to the client, it is not stored): {value}", file=sys.stderr)
    else:
        value = sys.stdin.readline().strip()
        if not value:
            print("primerl: no token on stdin (pipe one in, or pass --new)", file=sys.stderr)
            return 2
    print(f"{args.tenant}:{hash_token(value)}")
    return 0


def inspector_url(url: str) -> str:
    """The page of the front door at ``url`` (``host:port``, with or without a scheme or a trailing /ui)."""
    base = url.strip().rstrip("/")
    if "://" not in base:
        base = f"http://{base}"
    return (base[: -len("/ui")] if base.endswith("/ui") else base) + "/ui"


def _inspect(args: argparse.Namespace) -> int:
    """``primerl inspect URL``: print the page's URL; open it where a graphical browser can show it."""
    import os
    import webbrowser

    import httpx

    page = inspector_url(args.url)
    print(page)
    try:
        httpx.get(page[: -len("/ui")] + "/liveness", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        print(f"primerl inspect: no bridge answers at {page[: -len('/ui')]} ({exc})", file=sys.stderr)
        return 1
    graphical = sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )
    if not args.no_open and graphical:
        webbrowser.open(page)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inference"]:  # prime-rl's name of the inference component: the bridge
        argv = ["serve", *argv[1:]]
    if argv[:1] == ["bench"]:  # its own flags (bench/matrix.py), passed through
        return _bench(argv[1:])
    if argv[:1] and argv[0] in RL_COMMANDS:  # layered config (@ FILE, --section.key): grpo.cli, imported now (torch)
        from grpo.cli import run_command

        return run_command(argv[0], argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":  # only serve takes layered-config tokens (@ FILE, --section.key)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "placement": run_placement,
        "verifier": run_verifier,
        "eval": run_eval_command,
        "llmserve": run_llmserve,
        "sandbox": run_sandbox,
        "engine": run_engine_command,
        "control": run_control,
        "replicas": run_replicas,
        "hash-token": _hash_token,
        "inspect": _inspect,
    }
    if (run := commands.get(args.command)) is not None:  # every subcommand but serve
        return run(args)
    configure_logging(args.log_level)
    if args.command == "serve":
        if args.help:
            print(args.serve_help())
            extra = [*extra, "--help"]
        try:
            settings = run_cli(
                Settings,
                extra,
                prog="primerl serve",
                files=[args.config] if args.config else [],
                overrides=_serve_overrides(args),
                env_aliases=ENV_ALIASES,
            )
        except SystemExit as exc:  # --help, --dry-run (0) or an invalid configuration (2, already said)
            return int(exc.code or 0)
        from server.app import serve
        from server.errors import PrimeRLError

        try:
            if settings.server.workers > 1:  # the parent of N bridge processes (server.fleet.workers)
                from server.fleet.workers import run_workers

                return run_workers(settings, serve, args.log_level)
            asyncio.run(serve(settings))
        except (PrimeRLError, OSError) as exc:
            print(f"primerl: cannot start the bridge: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
