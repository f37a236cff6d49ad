"""Issue 19, acceptance 5: schemathesis over every route of the front door's served ``openapi.json``.

A real bridge (toy engine, auth on, the caller an admin tenant) serves the front door on a free port from
its own thread and event loop (schemathesis' client is synchronous); the schema fuzzed is the one it
serves. Every operation gets a bounded number of generated requests, valid and invalid (examples,
coverage and fuzzing phases). No response may be a server error, and every error must be OpenAI's error JSON
``{"error": {"message", "type", "param", "code"}}`` with ``code`` equal to the status.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engines.launch import free_port
from server.app import BridgeServer, create_server
from server.auth import hash_token
from server.config import load_settings
from server.http.app import ROUTES, VERSION
from server.http.openapi import build

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

pytestmark = pytest.mark.slow
TOKEN = "tok-fuzz"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Per operation and phase (PRIMERL_FUZZ_EXAMPLES for a longer hunt): 13 operations stay well under a minute.
EXAMPLES = int(os.environ.get("PRIMERL_FUZZ_EXAMPLES", "100"))


class BridgeThread:
    """A bridge with the front door, served by an event loop on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-bridge", daemon=True)
        self.thread.start()
        self.server: BridgeServer = self.run(self._start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start(self) -> BridgeServer:
        settings = load_settings(
            engine={"type": "toy", "toy": {"supports_weight_updates": True, "supports_scoring": True}},
            server={"port": 0, "grace_period_s": 1.0},
            metrics={"port": 0},
            auth={"token_hashes": [f"fuzz:{hash_token(TOKEN)}"], "admin_tenants": ["fuzz"]},
            http={"port": free_port()},
        )
        server = await create_server(settings)
        await server.start()
        return server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    def close(self) -> None:
        try:
            self.run(self.server.stop(0.5))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def bridge() -> Iterator[BridgeThread]:
    b = BridgeThread()
    yield b
    b.close()


# The schema the front door serves, built at import (schemathesis' fixture-loaded schemas break under pytest 9.2,
# whose nodes have no ``_nodeid``); ``test_the_fuzzed_schema_is_the_served_one`` pins it to GET /openapi.json.
SCHEMA = build(ROUTES, VERSION)
schema = schemathesis.openapi.from_dict(SCHEMA)


def test_the_fuzzed_schema_is_the_served_one(bridge: BridgeThread) -> None:
    served = httpx.get(f"{bridge.url}/openapi.json", timeout=10).json()
    assert served == SCHEMA
    assert len([op for ops in served["paths"].values() for op in ops]) == len(ROUTES)
    # Findings: a body whose every field has a default may be left out (documented as optional); a 405
    # says which methods the route has.
    assert served["paths"]["/v1/sessions"]["post"]["requestBody"]["required"] is False
    assert served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["required"] is True
    r = httpx.request("TRACE", f"{bridge.url}/v1/models", headers=AUTH, timeout=10)
    assert (
        r.status_code == 405
        and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
        and r.json()["error"]["code"] == 405
    )


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> None:
    """schemathesis' ``not_a_server_error``, except 501: the bridge's answer, by design (gRPC's UNIMPLEMENTED),
    when the engine lacks a capability the request needs (found by a full run: an adapter update on the toy
    engine, which serves no LoRA; ``test_adapter_errors.py`` pins that answer)."""
    assert response.status_code < 500 or response.status_code == 501, (response.status_code, response.text)


@schemathesis.check
def openai_error_json(ctx: Any, response: Any, case: Any) -> None:
    """Every error is OpenAI's error JSON, ``code`` = the status (what the SDK parses into ``APIStatusError``)."""
    if response.status_code < 400:
        return
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] == response.status_code, err


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_openai_error_json(case: Any, bridge: BridgeThread) -> None:
    try:
        response = case.call(base_url=bridge.url, headers=AUTH, timeout=30)
        case.validate_response(response, checks=[no_server_error, openai_error_json])
    finally:
        if case.path == "/pause":  # never leave the bridge paused for the next operation
            bridge.run(_resume(bridge.server))


async def _resume(server: BridgeServer) -> None:
    server.bridge.resume()


def test_a_group_call_runs_its_members_under_distinct_request_ids(bridge: BridgeThread) -> None:
    """Schemathesis' first finding: the members of an ``n`` > 1 call shared one engine request id, and two
    that overlapped crashed the bridge's bookkeeping (500)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 200, "ignore_eos": True}
    r = httpx.post(f"{bridge.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert [len(c["message"]["content"].split()) > 50 for c in r.json()["choices"]] == [True] * 4
