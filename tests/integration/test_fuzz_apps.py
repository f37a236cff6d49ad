"""Issue 25, acceptance 4: schemathesis over every HTTP app a user reaches besides the front door.

Each app runs on a real uvicorn server on a free port, on a thread of its own (schemathesis' client is
synchronous), and is fuzzed through an OpenAPI document (examples, coverage and fuzzing phases):

- the Env Hub's OpenEnv app (``envhub.openenv.create_app``, openenv-core's server) serving ``sql-qa`` and
  ``code-math``: its own ``/openapi.json`` (over HTTP, ``/step`` is stateless as openenv-core defines it, so a
  step meets a fresh environment: the 409 path; the tools are reached over ``/ws`` in test_envhub_openenv.py);
- LLMServeEnv (openenv-core's FastAPI app plus /tasks, /grader, /baseline): its own ``/openapi.json``;
- the verifier (``primerl verifier serve``, SQLite log): no OpenAPI document either; written here from its
  documented routes with the request bodies' JSON schemas taken from the pydantic models the app validates with.

No response may be a server error, every documented error is JSON in the app's error format, and the server still
answers its health route afterwards (nothing crashed). ``PRIMERL_FUZZ_EXAMPLES`` sets the examples per operation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from engines.launch import free_port

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("PRIMERL_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
COUNTS: dict[str, int] = {}  # requests sent per app, printed at the end of the module (pytest -s)


@pytest.fixture(scope="module", autouse=True)
def _print_counts() -> Iterator[None]:
    yield
    print(f"\nfuzzed requests per app: {COUNTS}")


class Served:
    """An ASGI app (or the verifier's ``serve`` coroutine) on a free port, in a thread with its own loop."""

    def __init__(self, app: Any = None, serve: Callable[[int, asyncio.Event], Any] | None = None) -> None:
        self.port = free_port()
        self.ready = threading.Event()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self.loop = asyncio.new_event_loop()
        self._serve = serve
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-app", daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        assert self.ready.wait(30), "the app did not start"

    async def _main(self) -> None:
        if self._serve is not None:
            started = asyncio.Event()
            self.inner = asyncio.ensure_future(self._serve(self.port, started))
            await started.wait()
        else:
            self.inner = asyncio.ensure_future(self.server.serve())
            while not self.server.started:  # noqa: ASYNC110 (uvicorn exposes no event for "listening")
                await asyncio.sleep(0.01)
        self.ready.set()
        await self.inner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        assert not self.task.done(), f"the server stopped during the fuzzing: {self.task.exception()!r}"
        self.server.should_exit = True  # uvicorn's graceful stop; the verifier's serve() stops on cancel
        if self._serve is not None:
            self.loop.call_soon_threadsafe(self.inner.cancel)
        with contextlib.suppress(asyncio.CancelledError, concurrent.futures.CancelledError):
            self.task.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _op(body: dict[str, Any] | None = None, required: bool = True, **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"responses": {"default": {"description": "any"}}, **extra}
    if body is not None:
        op["requestBody"] = {"required": required, "content": {"application/json": {"schema": body}}}
    return op


def _doc(paths: dict[str, Any], components: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "fuzzed", "version": "1"},
        "paths": paths,
        "components": {"schemas": components or {}},
    }


def _send(case: Any, url: str, app: str, checks: list[Any]) -> None:
    response = case.call(base_url=url, timeout=60)
    COUNTS[app] = COUNTS.get(app, 0) + 1
    case.validate_response(response, checks=checks)


# -- the Env Hub's OpenEnv app ---------------------------------------------------------------------


@schemathesis.check
def hub_error_json(ctx: Any, response: Any, case: Any) -> None:
    """Errors are JSON: the hub's own (400 bad input, 409 out of order) as ``{"error", "code"}``, and what
    openenv-core/FastAPI reject before the environment sees it (an unparsable body, a type error) as ``{"detail"}``."""
    if response.status_code >= 400:
        body = response.json()
        if "detail" in body:
            assert set(body) == {"detail"} and body["detail"], body
        else:
            assert set(body) == {"error", "code"} and isinstance(body["error"], str) and body["error"], body


def _hub_app(name: str) -> Any:
    from envhub.openenv import create_app
    from envhub.registry import make_env

    return create_app(lambda: make_env(name), name)


HUB_DOC = _hub_app("sql-qa").openapi()  # openenv-core's document; the same routes and types for every hub env
HUB = schemathesis.openapi.from_dict(HUB_DOC)


def _serve_hub(name: str) -> Iterator[Served]:
    served = Served(_hub_app(name))
    yield served
    _assert_alive(served.url + "/health")
    served.close()


@pytest.fixture(scope="module")
def sql_hub() -> Iterator[Served]:
    yield from _serve_hub("sql-qa")


@pytest.fixture(scope="module")
def code_hub() -> Iterator[Served]:
    yield from _serve_hub("code-math")


def _assert_alive(url: str) -> None:
    assert httpx.get(url, timeout=10).status_code == 200, "the app no longer answers its health route"


def test_the_hub_schema_is_the_served_one(sql_hub: Served, code_hub: Served) -> None:
    for served in (sql_hub, code_hub):
        assert httpx.get(served.url + "/openapi.json", timeout=10).json() == HUB_DOC


@HUB.parametrize()
@SETTINGS
def test_hub_sql_qa_no_server_error(case: Any, sql_hub: Served) -> None:
    _send(case, sql_hub.url, "envhub openenv (sql-qa)", [not_a_server_error, hub_error_json])


@HUB.parametrize()
@SETTINGS
def test_hub_code_math_no_server_error(case: Any, code_hub: Served) -> None:
    _send(case, code_hub.url, "envhub openenv (code-math)", [not_a_server_error, hub_error_json])


# -- LLMServeEnv ---------------------------------------------------------------------------------------


def _llmserve_app() -> Any:
    from llmserve.app import build_app

    return build_app()


LLMSERVE_DOC = _llmserve_app().openapi()
LLMSERVE = schemathesis.openapi.from_dict(LLMSERVE_DOC)


@pytest.fixture(scope="module")
def llmserve() -> Iterator[Served]:
    served = Served(_llmserve_app())
    yield served
    _assert_alive(served.url + "/health")
    served.close()


def test_the_llmserve_schema_is_the_served_one(llmserve: Served) -> None:
    assert httpx.get(llmserve.url + "/openapi.json", timeout=10).json() == LLMSERVE_DOC


@LLMSERVE.parametrize()
@SETTINGS
def test_llmserve_no_server_error(case: Any, llmserve: Served) -> None:
    _send(case, llmserve.url, "llmserve", [not_a_server_error])


# -- the verifier ----------------------------------------------------------------------------------------


def verifier_openapi() -> dict[str, Any]:
    from verifier.service import BatchRequest, ScoreRequest

    components: dict[str, Any] = {}

    def ref(model: Any) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def query(*names: str) -> list[dict[str, Any]]:
        return [{"name": n, "in": "query", "required": True, "schema": {"type": "integer"}} for n in names]

    get = _op()
    paths = {
        "/v1/score": {"post": _op(ref(ScoreRequest))},
        "/v1/score/batch": {"post": _op(ref(BatchRequest))},
        "/v1/log/checkpoint": {"get": get},
        "/v1/log/entries/{index}": {
            "get": _op(parameters=[{"name": "index", "in": "path", "required": True, "schema": {"type": "string"}}])
        },
        "/v1/log/proof/inclusion": {"get": _op(parameters=query("index", "tree_size"))},
        "/v1/log/proof/consistency": {"get": _op(parameters=query("first", "second"))},
        "/v1/keys": {"get": get},
        "/healthz": {"get": get},
    }
    return _doc(paths, components)


VERIFIER = schemathesis.openapi.from_dict(verifier_openapi())


@schemathesis.check
def verifier_error_json(ctx: Any, response: Any, case: Any) -> None:
    """The verifier's documented errors: ``{"error": {"code", "message", "fields"?}}``."""
    if response.status_code >= 400:
        err = response.json()["error"]
        assert {"code", "message"} <= set(err) <= {"code", "message", "fields"} and err["message"], err


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from verifier.cli import serve
    from verifier.config import VerifierConfig

    tmp = tmp_path_factory.mktemp("verifier")

    def start(port: int, ready: asyncio.Event) -> Any:
        config = VerifierConfig(
            http_port=port,
            grpc_port=0,  # any free port (the verifier's gRPC surface is not fuzzed here)
            database_url=f"sqlite:///{tmp / 'log.sqlite3'}",
            key_dir=str(tmp / "keys"),
            origin="f/log",
        )
        return serve(config, ready)

    served = Served(serve=start)
    # A few entries, so proofs and entry reads have something to serve.
    for value in (0.0, 0.5, 1.0):
        traj = {"episode_id": "e", "token_ids": [1, 2], "logprobs": [None, -0.5], "loss_mask": [0, 1],
                "origins": ["prompt", "sampled"], "policy_versions": [0, 0]}  # fmt: skip
        body = {"grader": "constant", "trajectory": traj, "params": {"value": value}}
        assert httpx.post(served.url + "/v1/score", json=body, timeout=30).status_code == 200
    yield served
    _assert_alive(served.url + "/healthz")
    served.close()


@VERIFIER.parametrize()
@SETTINGS
def test_verifier_no_server_error(case: Any, verifier: Served) -> None:
    _send(case, verifier.url, "verifier", [not_a_server_error, verifier_error_json])
