"""``primerl verifier serve``'s HTTP JSON surface on a free port, SQLite- and PostgreSQL-backed.

Scores go in over HTTP, the material a client keeps comes back over HTTP, and ``primerl verifier
verify`` checks it offline from files. Proofs served over HTTP are recomputed by the independent RFC 6962
implementation of tests/unit/test_verifier_merkle.py from the entries the server returns.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.launch import free_port
from envhub.graders import FnGrader, grader_names, register_grader
from server.cli import main
from tests.integration.verifier_db import db_url
from tests.unit.test_verifier_merkle import Rfc6962
from verifier.cli import serve
from verifier.config import VerifierConfig

__all__ = ["db_url"]  # the fixture, parametrized over SQLite and PostgreSQL

TRAJECTORY = {
    "episode_id": "ep-1",
    "token_ids": [1, 4, 30, 7, 8],
    "logprobs": [None, None, -0.25, -1.5, float("nan")],
    "loss_mask": [0, 0, 1, 1, 0],
    "origins": ["prompt", "prompt", "sampled", 3, "env"],
    "policy_versions": [0, 0, 2, 2, 0],
}


def _slow(_: Any) -> float:
    time.sleep(1.0)
    return 1.0


if "test-slow" not in grader_names():  # the registry is process-wide: register once
    register_grader(FnGrader("test-slow", _slow))


@pytest.fixture
async def verifier(db_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    port = free_port()
    config = VerifierConfig(
        http_port=port,
        grpc_port=0,
        database_url=db_url,
        key_dir=str(tmp_path / "keys"),
        grader_timeout_s=0.3,
        origin="t/log",
    )
    ready = asyncio.Event()
    task = asyncio.create_task(serve(config, ready), name="verifier-under-test")
    await asyncio.wait_for(ready.wait(), 30)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client
    if task.done():
        task.result()  # the server stopped on its own: show why
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    return await client.post(path, content=json.dumps(body))  # NaN logprobs: Python's JSON, as clients send it


def _score(value: float, **traj: Any) -> dict[str, Any]:
    return {"grader": "constant", "trajectory": {**TRAJECTORY, **traj}, "params": {"value": value}}


async def test_score_then_verify_offline_with_the_cli(verifier: httpx.AsyncClient, tmp_path: Path) -> None:
    r = await post(verifier, "/v1/score", _score(0.75))
    assert r.status_code == 200, r.text
    scored = r.json()
    assert scored["reward"] == 0.75 and scored["receipt"]["log_index"] == 0
    early = (await verifier.get("/v1/log/checkpoint")).json()  # a checkpoint the client kept at tree size 1
    await asyncio.gather(*(post(verifier, "/v1/score", _score(i, episode_id=f"e{i}")) for i in range(6)))
    checkpoint = (await verifier.get("/v1/log/checkpoint")).json()
    assert checkpoint["tree_size"] == 7 and checkpoint["origin"] == "t/log"
    proof = (await verifier.get("/v1/log/proof/inclusion", params={"index": 0, "tree_size": 7})).json()
    files = {
        "envelope": scored,
        "proof": proof,
        "checkpoint": checkpoint,
        "keys": (await verifier.get("/v1/keys")).json(),
    }
    for name, body in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    argv = ["verifier", "verify", *(x for n in files for x in (f"--{n}", str(tmp_path / f"{n}.json")))]
    assert main(argv) == 0
    consistency = (await verifier.get("/v1/log/proof/consistency", params={"first": 1, "second": 7})).json()
    (tmp_path / "old.json").write_text(json.dumps(early))
    (tmp_path / "consistency.json").write_text(json.dumps(consistency))
    extend = ["--old-checkpoint", str(tmp_path / "old.json"), "--consistency", str(tmp_path / "consistency.json")]
    assert main([*argv, *extend]) == 0
    (tmp_path / "consistency.json").write_text(json.dumps({**consistency, "hashes": consistency["hashes"][1:]}))
    assert main([*argv, *extend]) == 1
    scored["receipt"]["envelope"]["payload"] = base64.b64encode(b'{"_type": "forged"}').decode()
    (tmp_path / "envelope.json").write_text(json.dumps(scored))
    assert main(argv) == 1


async def test_served_proofs_match_an_independent_rfc6962(verifier: httpx.AsyncClient) -> None:
    for i in range(3):
        r = await post(verifier, "/v1/score/batch", {"items": [_score(j, episode_id=f"b{i}-{j}") for j in range(4)]})
        assert r.status_code == 200 and all("receipt" in x for x in r.json()["results"])
    size = (await verifier.get("/v1/log/checkpoint")).json()["tree_size"]
    leaves = [base64.b64decode((await verifier.get(f"/v1/log/entries/{i}")).json()["leaf"]) for i in range(size)]
    root = base64.b64decode((await verifier.get("/v1/log/checkpoint")).json()["root_hash"])
    assert Rfc6962.mth(leaves) == root
    b64 = lambda hs: [base64.b64encode(h).decode() for h in hs]  # noqa: E731
    for n in (1, 5, 8, size):
        for m in range(n):
            got = (await verifier.get("/v1/log/proof/inclusion", params={"index": m, "tree_size": n})).json()
            assert got["hashes"] == b64(Rfc6962.path(m, leaves[:n]))
            got = (await verifier.get("/v1/log/proof/consistency", params={"first": m + 1, "second": n})).json()
            assert got["hashes"] == b64(Rfc6962.proof(m + 1, leaves[:n]))


async def test_same_input_same_verdict(verifier: httpx.AsyncClient) -> None:
    a, b = [(await post(verifier, "/v1/score", _score(0.5))).json() for _ in range(2)]
    pa, pb = (json.loads(base64.b64decode(x["receipt"]["envelope"]["payload"])) for x in (a, b))
    assert a["reward"] == b["reward"] == 0.5
    assert pa["subject"] == pb["subject"]
    assert set(pa["predicate"].pop("timings")) == set(pb["predicate"].pop("timings")) == {"started_at", "grade_seconds"}
    assert pa == pb  # everything but the timings is the same signed content


BAD_SCORES = [
    ({"grader": "constant", "trajectory": {**TRAJECTORY, "logprobs": [0.0]}, "params": {"value": 1}}, "logprobs"),
    ({"grader": "constant", "trajectory": {**TRAJECTORY, "origins": ["x"] * 5}}, "trajectory.origins.0"),
    ({"grader": "constant", "trajectory": {**TRAJECTORY, "token_ids": [-1, 0, 0, 0, 0]}}, "trajectory.token_ids"),
    ({"grader": "constant", "trajectory": {**TRAJECTORY, "extra": 1}}, "trajectory.extra"),
    ({"grader": "nope", "trajectory": TRAJECTORY}, "unknown grader"),
    ({"grader": "constant", "trajectory": TRAJECTORY}, "params.value"),
    ({"grader": "constant", "trajectory": TRAJECTORY, "params": {"value": float("inf")}}, "params"),
    ({"trajectory": TRAJECTORY}, "grader"),
    ([1, 2], "body"),
]
BAD_QUERIES = [
    ("/v1/log/entries/0", 404),
    ("/v1/log/entries/abc", 400),
    ("/v1/log/entries/\u00b2", 400),  # "²": str.isdigit() says yes, int() says no (a 500 before, found by schemathesis)
    ("/v1/log/proof/inclusion?index=0&tree_size=5", 400),
    ("/v1/log/proof/inclusion?index=x&tree_size=1", 400),
    ("/v1/log/proof/consistency?first=2&second=1", 400),
    ("/v1/nothing", 404),
]


async def test_bad_input_is_a_4xx_naming_the_field_and_appends_nothing(verifier: httpx.AsyncClient) -> None:
    for body, field in BAD_SCORES:
        r = await post(verifier, "/v1/score", body)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert field in r.json()["error"]["message"], (field, r.text)
    r = await verifier.post("/v1/score", content=b"{not json")
    assert r.status_code == 400 and "body" in r.json()["error"]["message"]
    for path, status in BAD_QUERIES:
        r = await verifier.get(path)
        assert r.status_code == status and r.json()["error"]["message"], (path, r.text)
    assert (await verifier.get("/v1/log/checkpoint")).json()["tree_size"] == 0


async def test_batch_items_fail_alone_on_their_deadline(verifier: httpx.AsyncClient) -> None:
    items = [_score(1.0), {"grader": "test-slow", "trajectory": TRAJECTORY}, _score(2.0)]
    r = await post(verifier, "/v1/score/batch", {"items": items})
    results = r.json()["results"]
    assert r.status_code == 200
    assert [x.get("reward") for x in results] == [1.0, None, 2.0]
    assert results[1]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert [x["receipt"]["log_index"] for x in (results[0], results[2])] == [0, 1]
    one = await post(verifier, "/v1/score", items[1])
    assert one.status_code == 504 and "grader_timeout_s" in one.json()["error"]["message"]


def test_primerl_verifier_serve_process_keeps_its_log_across_restarts(tmp_path: Path) -> None:
    """The real command: serve, score, SIGTERM (clean exit), serve again on the same files, verify."""
    import signal
    import subprocess
    import sys

    def run_once(value: float) -> dict[str, Any]:
        port = free_port()
        cmd = [sys.executable, "-m", "server", "verifier", "serve", "--http-port", str(port), "--grpc-port", "0"]
        cmd += ["--database-url", f"sqlite:///{tmp_path / 'log.sqlite3'}", "--key-dir", str(tmp_path / "keys")]
        with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stderr is not None and "primerl verifier: http://" in proc.stderr.readline()
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
                    scored = c.post("/v1/score", content=json.dumps(_score(value))).json()
                    size = c.get("/v1/log/checkpoint").json()["tree_size"]
                    proof = c.get("/v1/log/proof/inclusion", params={"index": 0, "tree_size": size}).json()
                    kept = {"checkpoint": c.get("/v1/log/checkpoint").json(), "keys": c.get("/v1/keys").json()}
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(20) == 0  # graceful: uvicorn drained, the log closed
        return {"scored": scored, "proof": proof, **kept}

    first = run_once(0.25)
    second = run_once(0.5)
    assert first["scored"]["receipt"]["log_index"] == 0 and second["scored"]["receipt"]["log_index"] == 1
    for name, body in {"envelope": first["scored"], "proof": second["proof"], **second}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    files = ("envelope", "proof", "checkpoint", "keys")
    assert main(["verifier", "verify", *(x for n in files for x in (f"--{n}", str(tmp_path / f"{n}.json")))]) == 0
