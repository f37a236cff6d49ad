"""Shared fixtures: real bridge servers on free ports, real clients."""

from __future__ import annotations

import ast
import ctypes
import errno
import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from engines.launch import free_port
from rl_client import AsyncBridgeClient
from server.app import BridgeServer, create_server
from server.config import load_settings
from tests.integration.postgres_proc import PrivatePostgres
from tests.integration.redis_proc import PrivateRedis

# A skip for a missing service fails the run (services are private fixtures or `make setup`); so does a run that
# leaves the editable install pointing away from this checkout; a SIGTERM'd run tears its fixtures (and their
# servers) down. tests/scheduling.py records every test's time and keeps the tests that share a server on one
# xdist worker.
pytest_plugins = ("tests.skip_guard", "tests.env_guard", "tests.sigterm_guard", "tests.scheduling")

StartBridge = Callable[..., Awaitable[tuple[BridgeServer, AsyncBridgeClient]]]

# Bridges started by tests (in process or as `primerl serve` children) leave the HTTP front door off unless
# a test asks for it on a free port (http={"port": engines.launch.free_port()}): never the shared 8000.
os.environ.setdefault("PRIMERL_HTTP__PORT", "0")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `make test-fast` (-m "not slow") never starts a vLLM
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a real engine server is in the slow tier whether or not its module says so."""
    for item in items:
        if item.get_closest_marker("engine") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def _marked_slow_as_a_whole(path: Path) -> bool:
    """Whether the module at ``path`` sets ``pytestmark`` to (a list with) ``pytest.mark.slow`` or
    ``pytest.mark.engine`` at its top level: every test in it is in the slow tier."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return False  # collected as usual: pytest reports the problem
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            return any(ast.unparse(m) in ("pytest.mark.slow", "pytest.mark.engine") for m in marks)
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m "not slow"`` (``make test-fast``): a module marked slow as a whole is not even imported (every xdist
    worker collects every module; those modules' imports, torch and the training stack, cost each worker seconds
    for tests it deselects anyway)."""
    if config.getoption("markexpr", "") != "not slow" or collection_path.suffix != ".py":
        return None
    return True if collection_path.name.startswith("test_") and _marked_slow_as_a_whole(collection_path) else None


_LIBC = ctypes.CDLL(None)  # this process's C library: glibc on the supported platforms (malloc_trim)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def release_memory(what: str) -> None:
    """Collect garbage and hand the freed heap pages back to the OS (``PRIMERL_TEST_RSS=1``: print the RSS)."""
    before = _rss_mib()
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    if os.environ.get("PRIMERL_TEST_RSS"):
        print(f"\n[rss] {before:,.0f} -> {_rss_mib():,.0f} MiB after the {what}")


@pytest.fixture(autouse=True, scope="module")
def _release_memory() -> Iterator[None]:
    """After each module, collect its garbage and hand the freed heap pages back to the OS. Modules that run
    models in this process (trainers, embedded engines) free gigabytes that glibc's arenas otherwise keep: the
    pytest process held 11-13 GB by the RL tests and, beside the vLLM servers and training children, was
    OOM-killed on a 24 GB machine. (A module whose every test builds a trainer releases after each test too:
    ``release_after_each_test``.)"""
    yield
    release_memory("module")


@pytest.fixture
def release_after_each_test() -> Iterator[None]:
    """For ``pytest.mark.usefixtures`` in modules whose tests each build a model in this process."""
    yield
    release_memory("test")


@pytest.fixture
async def start_bridge() -> AsyncIterator[StartBridge]:
    """Start a real gRPC bridge on a free port with settings overrides; returns (server, client)."""
    async with AsyncExitStack() as stack:

        async def start(**overrides: Any) -> tuple[BridgeServer, AsyncBridgeClient]:
            overrides.setdefault("engine", {}).setdefault("type", "toy")
            overrides.setdefault("server", {}).setdefault("port", 0)
            overrides["server"].setdefault("grace_period_s", 1.0)
            overrides.setdefault("metrics", {}).setdefault("port", 0)  # never the shared default 9300
            for attempt in range(3):
                try:
                    server = await create_server(load_settings(**overrides))
                    break
                except OSError as exc:
                    # The front door's port comes from free_port(): on two xdist workers another process can
                    # take it between the probe and the bind. Probe again (the bridge has no ephemeral HTTP port).
                    http = overrides.get("http", {})
                    if exc.errno != errno.EADDRINUSE or not http.get("port") or attempt == 2:
                        raise
                    http["port"] = free_port()
            await server.start()
            stack.push_async_callback(server.stop, 0.5)
            client = AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30)
            stack.push_async_callback(client.close)
            return server, client

        yield start


@pytest.fixture
async def bridge(start_bridge: StartBridge) -> tuple[BridgeServer, AsyncBridgeClient]:
    """A toy-engine bridge with default settings."""
    return await start_bridge()


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    """A private redis-server on a free port (never the shared one), gone after the test."""
    server = PrivateRedis()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL cluster on a free port (never the shared 5432) with an empty database ``test``."""
    server = PrivatePostgres()
    try:
        server.start(databases=("test",))
        yield server
    finally:
        server.close()
