"""One fleet bridge as its own process, over stand-in engine servers (``tests/standins/serve.py``).

``python -m tests.integration.fleet_bridge --port P --metrics-port M --kind sglang URL [URL ...]`` builds the
HTTP adapters the way ``test_failover_processes`` does (the toy model's facts and tokenizer, so no model
directory is needed) and serves ``create_server(settings, engines)`` until SIGTERM; every other setting comes
from ``PRIMERL_*`` (``PRIMERL_FLEET__ENABLED``, ``PRIMERL_REDIS__URL`` ...). ``FleetBridgeProcess`` is the test
side: start, wait until ready (started again on new ports if it exits first), ``kill()`` (SIGKILL), ``close()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

from engines.launch import free_port
from rl_client import AsyncBridgeClient
from tests.standins.serve import StandinProcess

ROOT = Path(__file__).resolve().parents[2]


def adapters(kind: str, urls: list[str]) -> list[Any]:
    from core.types import ModelFacts
    from engines.config import SglangConfig, ToyConfig, TrtllmConfig
    from engines.http.sglang import SglangEngine
    from engines.http.trtllm import TrtllmEngine
    from engines.toy import ToyEngine

    toy = ToyEngine(ToyConfig())  # what the stand-ins serve (same seed): facts and tokenizer
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    out: list[Any] = []
    for i, url in enumerate(urls):
        common: dict[str, Any] = {"model": "toy", "tokenizer": toy.tokenizer, "request_timeout_s": 30}
        options = {"connect_retries": 0, "control_timeout_s": 2.0}
        if kind == "sglang":
            out.append(SglangEngine(url, SglangConfig.model_validate(options), facts, replica=f"r{i}", **common))
        else:
            out.append(TrtllmEngine(url, TrtllmConfig.model_validate(options), facts, replica=f"r{i}", **common))
    return out


async def _serve(port: int, metrics_port: int, kind: str, urls: list[str]) -> None:
    from server.app import create_server
    from server.config import load_settings

    settings = load_settings(server={"port": port}, metrics={"port": metrics_port}, http={"port": 0})
    engines = adapters(kind, urls)
    await asyncio.gather(*(e.start() for e in engines))
    bridge_server = await create_server(settings, engines)
    await bridge_server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await bridge_server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    import logging

    parser = argparse.ArgumentParser(prog="python -m tests.integration.fleet_bridge", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--kind", choices=("sglang", "trtllm"), default="sglang")
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("FLEET_LOG_LEVEL", "WARNING"))
    asyncio.run(_serve(args.port, args.metrics_port, args.kind, args.urls))


class FleetBridgeProcess:
    """One ``python -m tests.integration.fleet_bridge`` child."""

    def __init__(self, urls: list[str], env: Mapping[str, str], kind: str = "sglang") -> None:
        """Over the stand-ins at ``urls``; no ``urls``: ``primerl serve`` with the engines ``env`` configures."""
        self._urls, self._env, self._kind = list(urls), dict(env), kind
        self._spawn()

    def _spawn(self) -> None:
        """Start the child on freshly probed ports."""
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "tests.integration.fleet_bridge", "--port", str(self.port)]
        cmd += ["--metrics-port", str(self.metrics_port), "--kind", self._kind, *self._urls]
        if not self._urls:
            cmd = [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--http-port", "0"]
            cmd += ["--metrics-port", str(self.metrics_port), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **self._env})
        self.address = f"127.0.0.1:{self.port}"
        self.client = AsyncBridgeClient(self.address)

    async def ready(self, timeout: float = 180.0, respawns: int = 2) -> FleetBridgeProcess:
        """Wait until the child reports SERVING. A child that exits first is started again on new ports, at most
        ``respawns`` times: a port probed free can be bound by another process before the child binds it (seen:
        the metrics port, EADDRINUSE, then 180 s spent waiting on a dead child)."""
        import grpc

        from rl_client.errors import BridgeError, NotFoundError

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.proc.poll() is not None:
                if not respawns:
                    raise RuntimeError(f"bridge on port {self.port} exited with {self.proc.returncode} before SERVING")
                respawns -= 1
                print(f"bridge on port {self.port} exited with {self.proc.returncode} before SERVING: started again")
                await self.client.close()
                self._spawn()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"bridge on port {self.port} never reported SERVING in {timeout:.0f} s")
            try:
                await self.client.wait_until_ready(min(2.0, left))
                return self
            except NotFoundError:  # the gRPC port is up, the first health check not done yet
                await asyncio.sleep(0.1)
            except BridgeError as exc:  # not SERVING within this slice: look at the child, then wait again
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    async def close(self) -> None:
        await self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def standins(n: int, *extra: str, kind: str = "sglang") -> Iterator[list[StandinProcess]]:
    """``n`` stand-in engine processes on free ports (``extra``: their flags), stopped on exit."""
    procs = [StandinProcess(kind, free_port(), *extra) for _ in range(n)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


@contextlib.asynccontextmanager
async def bridge_pair(
    urls: list[str], env: Mapping[str, str], timeout: float = 180.0
) -> AsyncIterator[tuple[FleetBridgeProcess, ...]]:
    """Two fleet bridges over ``urls`` (none: ``primerl serve`` as ``env`` says), ready, closed on exit."""
    bridges = (FleetBridgeProcess(urls, env), FleetBridgeProcess(urls, env))
    try:
        await asyncio.gather(*(b.ready(timeout) for b in bridges))
        yield bridges
    finally:
        await asyncio.gather(*(b.close() for b in bridges))


def fleet_env(redis_url: str, **extra: str) -> dict[str, str]:
    """The settings of a fleet bridge on ``redis_url`` (heartbeat short so tests converge fast)."""
    return {
        "PRIMERL_REDIS__URL": redis_url,
        "PRIMERL_FLEET__ENABLED": "true",
        "PRIMERL_FLEET__HEARTBEAT_S": "0.3",
        "PRIMERL_FLEET__POLL_S": "0.05",
        "PRIMERL_FLEET__UPDATE_TIMEOUT_S": "20",
        "PRIMERL_CACHE__BLOCK_SIZE": "4",
        # The routing index's writes and lookups get budgets a loaded CI machine meets (tests read the index).
        "PRIMERL_CACHE__LOOKUP_BUDGET_MS": "500",
        "PRIMERL_CACHE__WRITE_TIMEOUT_MS": "2000",
        "PRIMERL_CACHE__BACKOFF_S": "0",
        "PRIMERL_METRICS__HEALTH_INTERVAL_S": "600",
        **extra,
    }


if __name__ == "__main__":
    main()
